"""Two ``pack_pair_triton`` calls (fp16+sr anchor, nvfp4 read copy) on a random float32 S of
the H200 geometries at B = 256, for Nsight Compute to profile the second (issue 15,
twenty-third pass, docs/kernels-replay.md "Where the time goes")::

    ncu --clock-control none --csv --page details --kernel-name regex:_pair_kernel \\
        --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \\
        python3 benchmarks/pair_cast_ncu.py mamba2 > $OUT/ncu_pair_mamba2.csv
"""

import sys

import torch

from replayssm_quant.kernels.quant import pack_pair_triton

GEOS = {"gdn": (256, 32, 128, 128), "mamba2": (256, 128, 64, 128)}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in GEOS:
        raise SystemExit(f"usage: pair_cast_ncu.py {{{'|'.join(GEOS)}}}")
    if not torch.cuda.is_available():
        raise SystemExit("pair_cast_ncu.py launches CUDA kernels; run it on the device")
    geo = GEOS[sys.argv[1]]
    S = torch.randn(*geo, device="cuda")
    keys = torch.arange(geo[0] * geo[1], device="cuda").view(geo[0], geo[1])
    for _ in range(2):  # the first compiles
        pack_pair_triton(S, "fp16+sr", "nvfp4", seed=1, plain_stream=keys, scaled_stream=keys)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
