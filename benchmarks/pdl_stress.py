"""Same bits under programmatic dependent launch (PDL), repeated, at a serving batch.

Runs the nvfp4 decode step of both models (Mamba-2; GDN, also with its lean records launch)
``N`` times with the read-pass forms ``"idot"`` and ``"idot_pdl"`` and PDL on, and counts the
repeats whose outputs or ring tensors differ in any bit from one run of ``"idot"`` with PDL
off. A race in the launch order (a dependent launch reading before the grid it depends on
has finished) would show as a non-zero count. CUDA only (PDL needs compute capability 9.0).

    python benchmarks/pdl_stress.py B H G V K CAP N     # e.g. 256 32 16 128 128 8 10

Written by a review helper in the twenty-sixth session (docs/kernels-replay.md).
"""
from __future__ import annotations

import argparse

import torch

import replayssm_quant.kernels.replay as kr
from replayssm_quant.quant import pack


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("B", "H", "G", "V", "K", "CAP", "N"):
        ap.add_argument(name, type=int)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (programmatic dependent launch)")
    d = "cuda"
    gen = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=gen).to(d)

    def decays(*s):
        return torch.log(0.9 + 0.0999 * torch.rand(*s, generator=gen)).to(d)

    def unit(*s):
        return torch.nn.functional.normalize(r(*s), dim=-1)

    def bits(x):
        return x.contiguous().view(torch.int32)

    B, H, G, V, K, C, N = a.B, a.H, a.G, a.V, a.K, a.CAP, a.N
    R = pack(r(B, H, V, K) * 0.3, "nvfp4", seed=1,
             stream=torch.arange(B * H, device=d).view(B, H))
    h = torch.randint(0, C - 1, (B,), generator=gen).to(d)
    bad_total = 0
    for gdn in (False, True):
        ring = dict(la=decays(B, C, H), v=r(B, C, H, V), k=unit(B, C, G, K))
        if gdn:
            ring.update(beta=torch.sigmoid(r(B, C, H)), uR=r(B, C, H, V))
        la, v, k = decays(B, H), r(B, H, V), unit(B, G, K)
        q, beta = r(B, G, K) / K ** 0.5, torch.sigmoid(r(B, H))

        def step(rg, **kw):
            if gdn:
                o = kr.gdn_step_kernel(R, rg, q, k, v, la, beta, h, **kw)
            else:
                o = kr.mamba2_step_kernel(R, rg, la, v, k, q, h, **kw)
            return [o] + [rg[n] for n in sorted(rg)]

        tile = (64, 1) if gdn else (128, 1)
        # GDN: the records kernel's records launch (False) and the lean one
        for lr in ([False, (1, 1, True)] if gdn else [None]):
            extra = dict(lean_records=lr) if lr is not None else {}
            want = step({n: t.clone() for n, t in ring.items()}, read_pass=tile + ("idot",),
                        pdl=False, **extra)
            for form in ("idot", "idot_pdl"):
                runs = [step({n: t.clone() for n, t in ring.items()},
                             read_pass=tile + (form,), **extra) for _ in range(N)]
                bad = sum(any(not torch.equal(bits(x), bits(y)) for x, y in zip(want, got))
                          for got in runs)
                bad_total += bad
                print("gdn" if gdn else "mamba2", lr, form, "differing", bad, "/", N,
                      flush=True)
    return 1 if bad_total else 0


if __name__ == "__main__":
    raise SystemExit(main())
