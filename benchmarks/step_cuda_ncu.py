"""Launch GDN's CUDA decode step (``kernels/replay/gdn_step.cu``) three times on
``decode.py``'s geometry (B = 256, 32 value heads, 16 key heads, 128 x 128, L = 16, the ring
``decode.make_set`` builds for 8 drafts), every sequence at ring position ``--h``, for
Nsight Compute to profile one launch (launch 0 builds and warms).

Usage (on the device)::

    ncu --kernel-name regex:step_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \\
        -o REPORT python3 benchmarks/step_cuda_ncu.py --h 7 --stage 3
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

from replayssm_quant.kernels.replay import cuda_step as cs  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

POLICIES = {"fp32": "f32", "read:nvfp4/rec:fp16+sr": "nvfp4"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="read:nvfp4/rec:fp16+sr", choices=list(POLICIES))
    ap.add_argument("--h", type=int, default=7, help="ring position (0..15)")
    ap.add_argument("--stage", type=int, default=None,
                    help="launch form (default: the format's, cuda_step.GDN_STEP_CUDA_CONFIG)")
    args = ap.parse_args(argv)
    fmt = POLICIES[args.policy]
    if args.stage is not None and args.stage not in cs.STAGES[fmt]:
        ap.error(f"--stage {args.stage}: {args.policy} has stages {cs.STAGES[fmt]}")
    if not 0 <= args.h < 16:
        ap.error(f"--h {args.h}: expected a ring position 0..15")
    if not torch.cuda.is_available():
        raise SystemExit("step_cuda_ncu.py needs a CUDA device")
    M = rk.Model("gdn", 256, 32, 16, 128, 128, 16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    st = dc.make_set(M, gen, StatePolicy.parse(args.policy), 8, False)
    h = torch.full((M.B,), args.h, dtype=torch.int64, device="cuda")
    for _ in range(3):
        cs.gdn_step_cuda(st["R"], st["ring"], st["q"], st["nk"], st["nv"], st["nla"],
                         st["nbeta"], h, stage=args.stage, fallback=False)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
