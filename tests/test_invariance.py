"""Batch, batch-position, segmentation and thread-count invariance of the ReplaySSM state path
(issue 12, item 1; replay/window.py "Invariance").

A sequence's outputs, recurrence anchors and read copies must be the same bits whatever batch
it shares, wherever it sits in that batch, and however its tokens are cut into calls (one
token per call -- the adapters' step path -- included): in float32 a last-bit difference can
flip a rounding decision and the flipped quantum propagates through the anchor. The oracle is
the sequence run alone, in one call. Float32 throughout, the precision real runs use; the torch
path (CPU), where these guarantees are made (docs/invariance.md).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from replayssm_quant.adapters.state import LayerState, prefill_scan
from replayssm_quant.config import StateConfig

# Every kind of policy: exact, single checkpoint (RTN / SR, block and tensor scales), eager,
# separate precision with an exact, a half and an FP8 anchor.
POLICIES = ["fp32", "shared:nvfp4+sr", "shared:nvfp4", "eager:fp8e4m3", "shared:mxfp4",
            "read:nvfp4/rec:fp32", "read:nvfp4/rec:fp16+sr", "read:fp8e4m3+sr/rec:bf16"]
FAMILIES = ["mamba2", "gdn"]
L = 8


def _inputs(family: str, B: int, T: int, seed: int = 0) -> dict:
    """Post-activation layer inputs (as the adapters' ``extract`` gives them), float32."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if family == "gdn":
        HK, HV, DK, DV = 2, 4, 32, 16
        return {"q": torch.nn.functional.normalize(r(B, T, HK, DK), dim=-1) * DK ** -0.5,
                "k": torch.nn.functional.normalize(r(B, T, HK, DK), dim=-1),
                "v": r(B, T, HV, DV), "g": -0.1 * torch.rand(B, T, HV, generator=g),
                "beta": torch.rand(B, T, HV, generator=g)}
    H, P, G, N = 4, 16, 2, 32
    return {"x": r(B, T, H, P), "dt": 0.3 * torch.rand(B, T, H, generator=g),
            "A": -torch.rand(H, generator=g) - 0.1, "B": r(B, T, G, N) * 0.3,
            "C": r(B, T, G, N) * 0.3}


def _rows(inp: dict, rows) -> dict:
    return {n: (t if n == "A" else t[rows]) for n, t in inp.items()}


def _seg(inp: dict, s: slice) -> dict:
    return {n: (t if n == "A" else t[:, s]) for n, t in inp.items()}


def _run(family, policy, inp, ids, cuts, prefill: int = 5):
    """Prefill ``prefill`` tokens exactly, then the rest in calls ending at ``cuts`` (a call
    of one token is a step). Returns (outputs [B, T, H, V], LayerState)."""
    pre = _seg(inp, slice(0, prefill))
    o0, S = prefill_scan(family, pre)
    st = LayerState(S, family=family, config=StateConfig.build(policy, window=L, seed=3), layer=2,
                    sequence_ids=torch.as_tensor(ids))
    outs, done = [o0], prefill
    for cut in cuts:
        part = _seg(inp, slice(done, cut))
        outs.append(st.step(part) if cut - done == 1 else st.advance(part))
        done = cut
    return torch.cat(outs, 1), st


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN payloads included)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_batch_invariance(family, policy):
    """Four sequences batched, in another order, and each alone: the same bits."""
    T = 45  # prefill 5, then a partial window, full windows and a partial tail
    inp = _inputs(family, 4, T, seed=1)
    ids = [11, 5, 7, 2]
    cuts = (9, 40, T)
    y, st = _run(family, policy, inp, ids, cuts)
    perm = [2, 0, 3, 1]
    yp, stp = _run(family, policy, _rows(inp, perm), [ids[i] for i in perm], cuts)
    for b in range(4):
        y1, st1 = _run(family, policy, _rows(inp, [b]), [ids[b]], cuts)
        p = perm.index(b)
        for got, alone in ((y[b], y1[0]), (st.anchor[b], st1.anchor[0]), (st.read[b], st1.read[0]),
                           (yp[p], y1[0]), (stp.anchor[p], st1.anchor[0]), (stp.read[p], st1.read[0])):
            assert _same(got, alone)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_segmentation_invariance(family, policy):
    """The same tokens in one call, in calls of 7, and one token per call (stepping): the same
    outputs, anchors and read copies, bit for bit."""
    T = 5 + 3 * L + 6
    inp = _inputs(family, 2, T, seed=2)
    ids = [3, 9]
    whole, st_w = _run(family, policy, inp, ids, (T,))
    sevens, st_7 = _run(family, policy, inp, ids, tuple(range(12, T, 7)) + (T,))
    steps, st_1 = _run(family, policy, inp, ids, tuple(range(6, T + 1)))
    for other, st in ((sevens, st_7), (steps, st_1)):
        assert _same(whole, other)
        assert _same(st_w.anchor, st.anchor) and _same(st_w.read, st.read)
        assert st.h == st_w.h and st.flushes == st_w.flushes


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_thread_count_invariance(family):
    """One and two intra-op threads give the same bits (the runner picks threads by load)."""
    inp = _inputs(family, 3, 40, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, st1 = _run(family, "read:nvfp4/rec:fp16+sr", inp, [1, 2, 3], (20, 40))
        torch.set_num_threads(2)
        y2, st2 = _run(family, "read:nvfp4/rec:fp16+sr", inp, [1, 2, 3], (20, 40))
    finally:
        torch.set_num_threads(before)
    assert _same(y1, y2) and _same(st1.anchor, st2.anchor) and _same(st1.read, st2.read)


@pytest.mark.parametrize("model", ["tiny-gdn", "tiny-mamba2"])
def test_kl_runner_batch_invariance(model, tmp_path):
    """``replayssm-kl`` on an embedded model and the KJV held-out text: every row of
    ``positions.parquet`` (reference NLL, KL, top-1, ...) is bit-identical with batch size 1
    and 3 (documents 1 and 2 change batch position), for rounded policies of every kind."""
    from replayssm_quant.evals.kl import main

    # N = 24 in segments of 10: a segment boundary inside a window of 4 (at 10) and one on a
    # flush (at 20); N = 48 in segments of 20 took 33-42 s per model on 2 cores (2026-12-06)
    common = ["--model", model, "--max-docs", "3", "-N", "24", "--windows", "4",
              "--segment-len", "10", "--policies", "eager:fp8e4m3", "shared:nvfp4+sr",
              "read:nvfp4/rec:fp16+sr", "--no-progress"]
    tables = []
    for bs in (1, 3):
        out = tmp_path / f"bs{bs}"
        assert main(common + ["--batch-size", str(bs), "-o", str(out)]) == 0
        t = pd.read_parquet(out / "positions.parquet")
        tables.append(t.sort_values(["doc", "policy", "window", "seed", "position"])
                      .reset_index(drop=True))
    assert len(tables[0]) == 3 * 3 * 24
    pd.testing.assert_frame_equal(tables[0], tables[1], check_exact=True)


def test_kl_runner_thread_count_invariance(tmp_path):
    """``replayssm-kl --threads 1`` and ``--threads 2`` give the same bits in every table,
    the stepwise check's included: its one-token calls over a cache run torch's CPU attention
    for a single query, whose sums follow the thread count (tiny-gdn has attention layers), so
    ``forward_segment`` runs them on one thread (a new-user trial found ``stepwise.parquet``
    moving with ``--threads``, 2026-12-06)."""
    from replayssm_quant.evals.kl import main

    common = ["--model", "tiny-gdn", "--max-docs", "1", "-N", "40", "--windows", "4",
              "--segment-len", "20", "--policies", "shared:nvfp4+sr", "--stepwise-check", "16",
              "--no-progress"]
    before = torch.get_num_threads()
    try:
        for t in (1, 2):
            assert main(common + ["--threads", str(t), "-o", str(tmp_path / f"t{t}")]) == 0
    finally:
        torch.set_num_threads(before)
    for name in ("positions", "stepwise"):
        a, b = (pd.read_parquet(tmp_path / f"t{t}" / f"{name}.parquet") for t in (1, 2))
        assert len(a) > 0
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert (tmp_path / "t1" / "summary.csv").read_text() == \
        (tmp_path / "t2" / "summary.csv").read_text()
