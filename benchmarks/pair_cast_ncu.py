"""Two ``pack_pair_triton`` calls (fp16+sr anchor, nvfp4 read copy) on a random float32 S of
the H200 geometries at B = 256, for Nsight Compute to profile the second (issue 15,
twenty-third pass, docs/kernels-replay.md "Where the time goes"); the kernel form (``generic``
or ``lean``) as an optional second argument::

    ncu --clock-control none --csv --page details --kernel-name regex:_pair \\
        --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \\
        python3 benchmarks/pair_cast_ncu.py mamba2 lean > $OUT/ncu_pair_mamba2_lean.csv

The seed is the benchmarks' (above 2^32, as in a flush): a seed of 1 would be specialised by
Triton to a compile-time constant and change the Philox code (until 2026-12-04 this script
used 1).
"""

import sys

import torch

from replayssm_quant.kernels.quant import PAIR_FORMS, pack_pair_triton

GEOS = {"gdn": (256, 32, 128, 128), "mamba2": (256, 128, 64, 128)}
SEED = 0x1234_5678_9ABC  # decode.py's and flush_tune.py's


def main():
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in GEOS or (
            len(sys.argv) == 3 and sys.argv[2] not in PAIR_FORMS):
        raise SystemExit(f"usage: pair_cast_ncu.py {{{'|'.join(GEOS)}}} "
                         f"[{'|'.join(PAIR_FORMS)}]")
    form = sys.argv[2] if len(sys.argv) == 3 else "generic"
    if not torch.cuda.is_available():
        raise SystemExit("pair_cast_ncu.py launches CUDA kernels; run it on the device")
    geo = GEOS[sys.argv[1]]
    S = torch.randn(*geo, device="cuda")
    keys = torch.arange(geo[0] * geo[1], device="cuda").view(geo[0], geo[1])
    for _ in range(2):  # the first compiles
        pack_pair_triton(S, "fp16+sr", "nvfp4", seed=SEED, plain_stream=keys, scaled_stream=keys,
                         form=form)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
