"""Check the Triton quantizer kernels against the torch reference on a GPU, and time them.

For every non-fp32 format, RTN and SR, at a serving shape (default [256, 32, 128, 128]: 256
sequences x 32 heads of a 128 x 128 FP32 state), this compares ``quantize_triton`` with
``quantize_reference`` (bit-for-bit mismatches, NaN positions included) and ``pack_triton``
with ``pack_reference`` (mismatched bytes of codes, block scales and matrix scales); the
reference runs on the same GPU in chunks of sequences (it is batch-independent: every matrix
carries its own stream key). A small tensor of special values (NaN, +-inf, -0.0, zeros, all-zero
blocks, subnormals, huge values, grid ties) is also compared with the reference run on the CPU.
Kernel times come from ``triton.testing.do_bench`` (median ms); GB/s counts the bytes read
(FP32 input) and written (FP32 output, or codes and scales).

Usage (writes one JSON file)::

    python benchmarks/check_quant_kernels.py --out results.json [--shape 256,32,128,128]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from types import SimpleNamespace

import torch
import triton
import triton.testing

from replayssm_quant.kernels.quant import pack_triton, quantize_triton
from replayssm_quant.philox import stream_key
from replayssm_quant.quant import pack_reference, quantize_reference

FORMATS = ["bf16", "fp16", "fp8e4m3", "fp8e5m2", "nvfp4", "mxfp8", "mxfp4"]
SEED = 0x1234_5678_9ABC
DEVICE = "cuda"


def value_mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    gn, wn = torch.isnan(got), torch.isnan(want)
    gi = torch.where(gn, 0, got.view(torch.int32))
    wi = torch.where(wn, 0, want.view(torch.int32))
    return int(((gn != wn) | (gi != wi)).sum())


def byte_mismatches(got, want) -> int:
    if got is None or want is None:
        return 0 if got is None and want is None else -1
    if got.shape != want.shape or got.dtype != want.dtype:
        return -1
    return int((got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)).sum())


def packed_mismatches(pg, pw) -> dict:
    return {
        "codes": byte_mismatches(pg.codes, pw.codes.to(pg.codes.device)),
        "block_scales": byte_mismatches(
            pg.block_scales, None if pw.block_scales is None else pw.block_scales.to(pg.device)),
        "matrix_scale": byte_mismatches(
            pg.matrix_scale, None if pw.matrix_scale is None else pw.matrix_scale.to(pg.device)),
    }


def serving_input(shape, seed: int = 0) -> torch.Tensor:
    """Gaussian state with per-row magnitudes spread over 4 decades (like decayed states)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(shape, device=DEVICE, generator=g)
    rows = torch.empty((*shape[:-1], 1), device=DEVICE).uniform_(-2, 2, generator=g)
    return x * torch.pow(10.0, rows)


def special_input() -> torch.Tensor:
    nan, inf = float("nan"), float("inf")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 16, 48, generator=g)  # the serving shape's int specialisations
    x[0, 0, :8] = torch.tensor([nan, -nan, inf, -inf, -0.0, 0.0, 1e-40, -1.4e-45])
    x[0, 1, :16] = 0.0
    x[0, 1, 16:32] = -0.0
    x[0, 2, 33] = -inf
    x[1] = 0.0
    x[1, :, ::2] = -0.0
    x[2] = torch.randn(16, 48, generator=g) * 1e-39  # subnormal amax, subnormal outputs
    x[2, 0] = torch.randn(48, generator=g) * 1e-44
    x[3] = torch.randn(16, 48, generator=g) * 1e37
    x[3, :4, 0] = torch.tensor([3.4028234663852886e38, -3.4e38, 3.0e38, -2.9e38])
    x[3, :, 7] = 1e-30
    x[4, 0, :16] = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 1.00048828125, 248.0, 465.0, 1e9,
                                 -1e9, 1.0 + 2**-8, 65520.0, 65519.0, 64512.0, -0.0, 6.0])
    x[4, 1] = torch.linspace(-500, 500, 48)
    return x


def bench(fn) -> float:
    if DEVICE != "cuda":  # smoke runs under TRITON_INTERPRET=1
        return float("nan")
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="256,32,128,128")
    ap.add_argument("--chunk", type=int, default=128, help="sequences per reference chunk")
    ap.add_argument("--cpu-check", type=int, default=4,
                    help="leading sequences also compared with the reference run on the CPU")
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--device", default="cuda", help="cpu: smoke test under TRITON_INTERPRET=1")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    shape = tuple(int(s) for s in args.shape.split(","))
    t_start = time.time()
    x = serving_input(shape)
    n = x.numel()
    streams = stream_key(sequence=torch.arange(shape[0])[:, None],
                         head=torch.arange(shape[1])[None, :]).to(DEVICE)
    xs = special_input()
    st_s = torch.arange(xs.shape[0], dtype=torch.int64) * 0x1_0000_0001 + 5
    rows = []
    for fmt in args.formats.split(","):
        for sr in (False, True):
            spec = fmt + ("+sr" if sr else "")
            t0 = time.time()
            out = quantize_triton(x, spec, seed=SEED, stream=streams)
            pk = pack_triton(x, spec, seed=SEED, stream=streams)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            compile_s = time.time() - t0
            vmis = 0
            pmis = {"codes": 0, "block_scales": 0, "matrix_scale": 0}
            for i in range(0, shape[0], args.chunk):
                sl = slice(i, i + args.chunk)
                ref = quantize_reference(x[sl], spec, seed=SEED, stream=streams[sl])
                vmis += value_mismatches(out[sl], ref)
                del ref
                pw = pack_reference(x[sl], spec, seed=SEED, stream=streams[sl])

                view = SimpleNamespace(  # the chunk of the kernel's packed result
                    codes=pk.codes[sl],
                    block_scales=None if pk.block_scales is None else pk.block_scales[sl],
                    matrix_scale=None if pk.matrix_scale is None else pk.matrix_scale[sl],
                    device=pk.codes.device)
                for key, v in packed_mismatches(view, pw).items():
                    pmis[key] = -1 if v < 0 or pmis[key] < 0 else pmis[key] + v
                del pw
            dec_mis = value_mismatches(pk.dequantize(), out)
            # the first sequences of the serving input: GPU kernel vs the reference on the CPU
            # (torch on CUDA divides by a Python scalar through its reciprocal, so the
            # reference's `amax / FMAX` is not correctly rounded there; on the CPU it is)
            cs = slice(0, args.cpu_check)
            xc, stc = x[cs].cpu(), streams[cs].cpu()
            cpu_vmis = value_mismatches(out[cs].cpu(), quantize_reference(xc, spec, seed=SEED,
                                                                          stream=stc))
            cview = SimpleNamespace(
                codes=pk.codes[cs],
                block_scales=None if pk.block_scales is None else pk.block_scales[cs],
                matrix_scale=None if pk.matrix_scale is None else pk.matrix_scale[cs],
                device=pk.codes.device)
            cpu_pmis = packed_mismatches(
                cview, pack_reference(xc, spec, seed=SEED, stream=stc).to(pk.codes.device))
            # special values: GPU kernel vs CPU reference
            sp_want = quantize_reference(xs, spec, seed=SEED, stream=st_s)
            sp_got = quantize_triton(xs.to(DEVICE), spec, seed=SEED, stream=st_s.to(DEVICE)).cpu()
            sp_pk = pack_triton(xs.to(DEVICE), spec, seed=SEED, stream=st_s.to(DEVICE))
            sp_pw = pack_reference(xs, spec, seed=SEED, stream=st_s)
            sp_pmis = packed_mismatches(sp_pk, sp_pw.to(DEVICE))
            sp_vmis = value_mismatches(sp_got, sp_want)
            # timing
            ms_q = bench(lambda: quantize_triton(x, spec, seed=SEED, stream=streams))
            ms_p = bench(lambda: pack_triton(x, spec, seed=SEED, stream=streams))
            packed_bytes = pk.nbytes
            row = {
                "spec": spec,
                "shape": list(shape),
                "elements": n,
                "value_mismatches": vmis,
                "packed_mismatches": pmis,
                "pack_dequantize_mismatches": dec_mis,
                "cpu_reference_sequences": args.cpu_check,
                "cpu_reference_value_mismatches": cpu_vmis,
                "cpu_reference_packed_mismatches": cpu_pmis,
                "special_value_mismatches": sp_vmis,
                "special_packed_mismatches": sp_pmis,
                "quantize_ms": ms_q,
                "quantize_GBps": (8 * n) / ms_q / 1e6,
                "pack_ms": ms_p,
                "pack_GBps": (4 * n + packed_bytes) / ms_p / 1e6,
                "packed_bytes": packed_bytes,
                "first_call_s": compile_s,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            del out, pk
    x_copy = torch.empty_like(x)
    ms_copy = bench(lambda: x_copy.copy_(x))
    result = {
        "command": "python benchmarks/check_quant_kernels.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v),
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "seed": SEED,
        "copy_ms": ms_copy,
        "copy_GBps": 8 * n / ms_copy / 1e6,
        "total_s": time.time() - t_start,
        "all_equal": all(
            r["value_mismatches"] == 0 and r["pack_dequantize_mismatches"] == 0
            and r["special_value_mismatches"] == 0
            and all(v == 0 for v in r["packed_mismatches"].values())
            and all(v == 0 for v in r["special_packed_mismatches"].values())
            for r in rows),
        "all_equal_cpu_reference": all(
            r["cpu_reference_value_mismatches"] == 0 and r["pack_dequantize_mismatches"] == 0
            and r["special_value_mismatches"] == 0
            and all(v == 0 for v in r["cpu_reference_packed_mismatches"].values())
            and all(v == 0 for v in r["special_packed_mismatches"].values())
            for r in rows),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)


if __name__ == "__main__":
    main()
