"""Build a CUDA C++ stand-in of ``benchmarks/cuda/`` as a torch extension (issue 15,
forty-first pass; device only: nvcc and ninja, as the lent image has them)."""

from __future__ import annotations

import os
import re
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.M)


def source(name: str) -> str:
    """The text of ``benchmarks/cuda/<name>`` with its local ``#include "x.cuh"`` lines
    replaced by the files' text (so the extension's build hash, taken over the source
    string, follows the shared header too)."""
    return _INCLUDE.sub(lambda m: (CUDA_DIR / m.group(1)).read_text(),
                        (CUDA_DIR / name).read_text())


def build(ext_name: str, name: str, decl: str, functions: list[str]):
    """``torch.utils.cpp_extension.load_inline`` of ``benchmarks/cuda/<name>`` for this
    device's architecture, with the C++ declarations ``decl`` of ``functions``."""
    import torch
    from torch.utils.cpp_extension import load_inline

    cap = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{cap[0]}.{cap[1]}")
    return load_inline(ext_name, cpp_sources=decl, cuda_sources=source(name), functions=functions,
                       extra_cuda_cflags=["-O3", "-std=c++17", "-Xptxas=-v"], verbose=True)
