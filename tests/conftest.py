"""Shared test configuration.

Tests are CPU-only: Triton kernels run under the interpreter (TRITON_INTERPRET=1), which must
be set before triton is imported anywhere.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny matmuls are far faster single-threaded on the shared 2-core CI machine.
torch.set_num_threads(1)
