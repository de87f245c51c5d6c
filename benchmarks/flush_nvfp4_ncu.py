"""Launch GDN's CUDA nvfp4 flush (``kernels/replay/gdn_flush.cu``) a few times on
``decode.py``'s geometry (B = 256, 32 value heads, 16 key heads, 128 x 128, J = 16), for
Nsight Compute to profile one launch: launch 0 builds and warms, launch 1 is the default
variant (``cuda_flush.GDN_FLUSH_CUDA_CONFIG``), launches 2 and 3 are variants 4 and 0 (the
tensor-core form unrolled once, and the FMA form).

Usage (on the device)::

    ncu --kernel-name regex:'flush_tc_kernel|flush_kernel' --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
        -o REPORT python3 benchmarks/flush_nvfp4_ncu.py [--policy read:nvfp4/rec:fp16]
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > src.csv
    python3 benchmarks/ncu_sass_summary.py src.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402
from flush_nvfp4_cuda import _serve  # noqa: E402

from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.kernels.replay.cuda_flush import GDN_FLUSH_CUDA_CONFIG  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="read:nvfp4/rec:fp16+sr",
                    choices=["read:nvfp4/rec:fp16+sr", "read:nvfp4/rec:fp16"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flush_nvfp4_ncu.py needs a CUDA device")
    M = rk.Model("gdn", 256, 32, 16, 128, 128, 16)
    pol = StatePolicy.parse(args.policy)
    st = dc.make_set(M, torch.Generator(device="cuda").manual_seed(5), pol, 8, False)
    fa = dc.flush_args(M, st)
    default = GDN_FLUSH_CUDA_CONFIG["variant"]
    for v in (default, default, 4, 0):  # the serving form, as flush_nvfp4_cuda.py times it
        _serve(lambda *x, v=v, **k: kr.gdn_flush_cuda(*x, variant=v, fallback=False, **k),
               M, st, pol, fa)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
