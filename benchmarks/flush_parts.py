"""Where a split nvfp4 flush spends its time (issue 15, 2026-12-04, twenty-second session).

``flush_kernel(split_casts=True)`` (the default for ``read:nvfp4/rec:fp16+sr`` since the ninth
pass) is two or three launches: the ``fp32`` flush writes a float32 S, then S is cast to the
anchor (fp16, SR) and to the read copy (nvfp4, with a matrix scale). This times, at B = 256 on
the H200 geometries (``flush_tune.py``'s sets):

* each launch alone (the fp32 flush, ``pack_triton`` per copy) and a device copy of S, the
  bandwidth reference;
* the whole split flush in each cast form (``--split-forms``; ``cast_form="separate"``: one
  ``pack_triton`` per copy; ``"pair"``: one launch casts S to both copies, loading each tile
  once for both; ``"pair_lean"`` / ``"pair_lean_rcp"``: that launch in its lean forms,
  twenty-seventh pass; ``+amax``: with ``flush_amax=True``, the matrix amax taken by the fp32
  flush as it writes S, so the cast reads S once, twenty-eighth pass), each form's stored
  copies compared byte for byte with the first form's (``same_bytes`` per form,
  ``pair_same_bytes`` for all). A form may carry options, in this order:
  ``NAME[+amax][#RxW][^N][%VARIANT:BLOCK_V:WARPS]``: ``#RxW`` the lean pair cast on tiles of R
  block rows and W warps (lean forms only; twenty-ninth pass), ``^N`` the fp32 flush's
  register cap (0: 255, i.e. none), ``%...`` the fp32 flush's launch (a launch the geometry
  refuses is recorded, not timed);
* with ``--pair-tiles``, ``pack_pair_triton`` alone in the forms of ``--tile-forms`` on
  several tiles, each tile's bytes against the first timed tile's.

CUDA-graph medians (``decode.timer``), 4 sets rotated.

Usage (on the device; fla not needed)::

    python benchmarks/flush_parts.py --pair-tiles --out $OUT/flush_parts_h200.json
    python benchmarks/flush_parts.py --tiny --out /tmp/fp.json   # CPU, TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--tiny" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import flush_tune as ft  # noqa: E402
from _commit import code_commit  # noqa: E402

import replayssm_quant.kernels.replay.flush as F  # noqa: E402
from replayssm_quant.kernels.quant import PAIR_FORMS, pack_pair_triton, pack_triton  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.quant import _finite_abs  # noqa: E402

POLICIES = ("read:nvfp4/rec:fp16+sr", "read:nvfp4/rec:fp16", "read:nvfp4/rec:fp32")
PAIR_TILES = ((128, 4), (64, 4), (64, 2), (128, 8), (256, 8), (32, 1))
# the lean forms hold a tile's block rows as 1-D tensors over the program's threads: rows
# below 32 x num_warps would be held twice, so their tiles have at least one row per thread;
# a tile of all the matrix's block rows (Mamba-2 512, GDN 1024) reads S once (SINGLE)
LEAN_TILES = ((128, 4), (256, 4), (64, 2), (256, 8), (512, 8), (1024, 16), (32, 1), (64, 1),
              (128, 2))


def _stored_equal(a, b) -> bool:
    return ft.stored_diff(a, b) == 0


def _split_form(form: str, default_cfg):
    """``(name, fp32 flush launch, register cap, pair tile)`` of a ``--split-forms`` entry
    ``NAME[+amax][#RxW][^N][%VARIANT:BLOCK_V:WARPS]``; SystemExit naming a bad entry."""
    def bad(why):
        raise SystemExit(f"--split-forms entry {form!r}: {why} (expected "
                         "NAME[+amax][#RxW][^N][%VARIANT:BLOCK_V:WARPS], NAME in "
                         f"{F.CAST_FORMS})")
    rest, launch = form.split("%", 1) if "%" in form else (form, None)
    rest, cap = rest.split("^", 1) if "^" in rest else (rest, None)
    name, tile = rest.split("#", 1) if "#" in rest else (rest, None)
    base = name.removesuffix("+amax")
    if base not in F.CAST_FORMS:
        bad(f"unknown cast form {base!r}")
    if name.endswith("+amax") and base not in F._PAIR_CAST_FORMS:
        bad("+amax applies to the pair forms")
    fcfg = default_cfg
    try:
        if launch:  # the fp32 flush's launch (its reconstruct form kept)
            var, bv, nw = launch.split(":")
            fcfg = (var, int(bv), int(nw), default_cfg[3])
        cap = None if cap is None else (int(cap) or 255)
        if tile:
            rows, nw = (int(x) for x in tile.split("x"))
            tile = (rows, nw)
    except ValueError:
        bad("a malformed option")
    if tile and base not in ("pair_lean", "pair_lean_rcp"):
        bad("#RxW applies to the lean pair forms")
    return name, fcfg, cap, tile


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the interpreter")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--pair-tiles", action="store_true",
                    help="also time pack_pair_triton alone in the --tile-forms on the (rows, "
                         "warps) of PAIR_TILES (generic) / LEAN_TILES (lean forms), each tile's "
                         "bytes against the first timed tile's")
    ap.add_argument("--tile-forms", default=None,
                    help="with --pair-tiles: comma list of the forms to time (PAIR_FORMS, "
                         "each with '+amax' for the matrix amax given, as the split flush's "
                         "fp32 flush hands it over); default all of them")
    ap.add_argument("--split-forms", default=None,
                    help="comma list of the whole split flushes to time, each "
                         "NAME[+amax][#RxW][^N][%%VARIANT:BLOCK_V:WARPS] (NAME in CAST_FORMS; "
                         "+amax: pair forms only; #RxW: the lean pair cast's tile, lean forms "
                         "only; ^N: the fp32 flush's register cap, 0 for 255, i.e. none; "
                         "%%...: the fp32 flush's launch); 'none': none; default every form")
    args = ap.parse_args()
    for form in (args.split_forms or "none").split(","):  # bad entries refused before any work
        if form != "none":
            _split_form(form, ("loop", 16, 2, "dot"))
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("flush_parts.py times CUDA launches; run it on the device (or --tiny)")
    out = {"command": " ".join(sys.argv), "code_commit": code_commit(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "timing": "CUDA graph, decode.timer" if not args.tiny else "host",
           "results": {}}
    fp32 = StatePolicy.parse("fp32")
    reps, n = (args.reps, 4) if not args.tiny else (2, 1)
    mode = "graph" if not args.tiny else None
    for M in ft.geometries(args.tiny):
        fk = ft.flush_kw(M)
        cfg = ft.launch_cfg(M.V, False, M.gdn, M.L)
        gen = torch.Generator(device=ft.DEV).manual_seed(5)
        for pstr in args.policies.split(","):
            pol = StatePolicy.parse(pstr)
            pool = [ft.make_set(M, gen, pol) for _ in range(n)]
            res = {}

            def t(fn):
                r = dc.timer(fn, n, reps, 3, mode=mode)
                return {"median_us": r["median_us"], "min_us": r["min_us"]}

            S = [ft.run_flush(M, st, fp32, fk, cfg)[0].checkpoints.anchor_stored for st in pool]
            keys = F._split_keys(0, fk["sequence_ids"], fk["flush_index"], M.B, M.H,
                                 S[0].device)
            res["fp32_flush_writes_S"] = t(lambda i: ft.run_flush(M, pool[i], fp32, fk, cfg))
            if not pol.rec.is_identity:
                res["pack_rec"] = t(lambda i: pack_triton(S[i], pol.rec, seed=ft.SEED,
                                                          stream=keys[0]))
            res["pack_read"] = t(lambda i: pack_triton(S[i], pol.read, seed=ft.SEED,
                                                       stream=keys[1]))
            res["copy_S"] = t(lambda i: S[i].clone())
            if args.pair_tiles and pol.read.info.scaling == "nvfp4":
                base = None
                # each matrix's finite amax, as the fp32 flush hands it to the cast (+amax)
                amax = [_finite_abs(x).amax(dim=(-2, -1)) for x in S]
                tile_forms = (args.tile_forms.split(",") if args.tile_forms
                              else list(PAIR_FORMS) + [f"{f}+amax" for f in PAIR_FORMS])
                for tform in tile_forms:
                    pform = tform.removesuffix("+amax")
                    given = tform.endswith("+amax")
                    for rows, nw in (PAIR_TILES if pform == "generic" else LEAN_TILES):
                        def fn(i, rows=rows, nw=nw, pform=pform, given=given):
                            return pack_pair_triton(S[i], pol.rec, pol.read, seed=ft.SEED,
                                                    plain_stream=keys[0], scaled_stream=keys[1],
                                                    rows=rows, num_warps=nw, form=pform,
                                                    matrix_amax=amax[i] if given else None)
                        got = fn(0)
                        base = got if base is None else base
                        same = all(_stored_equal(u, v) if u is not S[0] else True
                                   for u, v in zip(got, base))
                        res[f"pair_cast {tform} {rows}x{nw}"] = {**t(fn), "same_bytes": same}
            kw_split = dict(fk, split_casts=True)
            default_cfg = cfg  # the split applies its launch options to the fp32 flush
            runs = {}
            split_forms = F.CAST_FORMS + tuple(f"{f}+amax" for f in F._PAIR_CAST_FORMS)
            if args.split_forms:
                split_forms = [f for f in args.split_forms.split(",") if f != "none"]
            for form in split_forms:
                name, fcfg, cap, tile = _split_form(form, default_cfg)
                kw = dict(kw_split, cast_form=name.removesuffix("+amax"),
                          flush_amax=name.endswith("+amax"))
                if cap is not None:
                    kw["maxnreg"] = cap
                saved = dict(F.SPLIT_PAIR_TILES), F.SPLIT_PAIR_TILES_FROM
                if tile:  # the lean pair cast's tile, at any batch
                    F.SPLIT_PAIR_TILES[(M.V, M.K)] = tile
                    F.SPLIT_PAIR_TILES_FROM = 0
                try:
                    runs[form] = ft.run_flush(M, pool[0], pol, kw, fcfg)[0].checkpoints
                    res[f"split_{form}"] = t(lambda i, kw=kw, fcfg=fcfg: ft.run_flush(
                        M, pool[i], pol, kw, fcfg))
                    first = next(iter(runs.values()))
                    res[f"split_{form}"]["same_bytes"] = (
                        _stored_equal(first.anchor_stored, runs[form].anchor_stored)
                        and _stored_equal(first.read_stored, runs[form].read_stored))
                except ValueError as e:  # a launch this geometry refuses: recorded, not timed
                    res[f"split_{form}"] = {"refused": str(e)}
                finally:
                    F.SPLIT_PAIR_TILES.clear()
                    F.SPLIT_PAIR_TILES.update(saved[0])
                    F.SPLIT_PAIR_TILES_FROM = saved[1]
            if runs:  # every timed split form's copies equal the first's
                res["pair_same_bytes"] = all(res[f"split_{f}"]["same_bytes"] for f in runs)
            res["S_bytes"] = S[0].numel() * 4
            key = f"{M.name} {pstr}"
            out["results"][key] = res
            print(key, json.dumps(res), flush=True)
            pool = S = None  # free the B = 256 sets before the next policy
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
