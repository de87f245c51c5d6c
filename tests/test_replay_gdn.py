"""GDNReplayState against the references (issue 3 tests 1, 2, 3, 6, 9)."""

import pytest
import torch

import _replay_common as C
from _replay_inputs import Model, rel_err, run_steps

M = Model("gdn")


@pytest.mark.parametrize("L", [1, 5, 16, 64], ids=lambda L: f"L{L}")
def test_fp32_matches_float64_recurrence(L):
    C.check_fp32_matches_float64_recurrence(M, L)


@pytest.mark.parametrize("total", [100.0, 1000.0])
def test_fp32_error_bound_large_decays(total):
    C.check_fp32_error_bound_large_decays(M, total)


def test_read_copy_is_independent_cast():
    C.check_read_copy_is_independent_cast(M)


def test_read_not_derived_from_anchor():
    C.check_read_not_derived_from_anchor(M)


def test_read_format_never_enters_anchor():
    C.check_read_format_never_enters_anchor(M)


def test_cached_fold_lets_read_format_into_anchor():
    """The cached-fold variant is the counter-example: there the read format reaches A."""
    with pytest.raises(AssertionError):
        C.check_read_format_never_enters_anchor(M, fold_cached_corrections=True)


@pytest.mark.parametrize("fmt", ["fp16+sr", "bf16", "fp8e4m3", "fp8e5m2+sr", "nvfp4+sr", "mxfp4"])
@pytest.mark.parametrize("with_prefill", [False, True], ids=["zero", "prefill"])
def test_shared_window1_is_eager(fmt, with_prefill):
    C.check_shared_window1_is_eager(M, fmt, with_prefill)


def test_packed_nbytes():
    C.check_packed_nbytes(M)


def test_bad_inputs_leave_state_unchanged():
    C.check_bad_inputs(M)


def test_float64_working_dtype():
    C.check_dtype_float64_keeps_fp32_exact(M)


def test_anchor_stays_exact_with_nvfp4_reads_cached_fold_drifts():
    """Test 6: read:nvfp4/rec:fp32 keeps the anchor within 1e-6 (relative) of the FP32
    reference after 64 windows because the flush re-solves the corrections against A; folding
    the cached read-path corrections instead lets nvfp4 read error into A, which drifts."""
    L, windows = 4, 64
    T = L * windows
    inp = M.inputs(T=T, B=2, HK=1, HV=2, DK=32, DV=8, seed=9)
    _, S_ref = M.recurrent(inp)
    errs = {}
    for fold in (False, True):
        st = M.state(inp, "read:nvfp4/rec:fp32", window=L, fold_cached_corrections=fold)
        run_steps(st, M.tok, inp, T)
        assert int(st.committed.max()) == 0
        errs[fold] = float((st.anchor - S_ref).norm() / S_ref.norm())
    assert errs[False] < 1e-6
    assert errs[True] > 1e-2
    assert errs[True] > 1e6 * errs[False]


@pytest.mark.parametrize("policy", ["fp32", "shared:fp16+sr", "shared:nvfp4",
                                    "read:nvfp4/rec:fp32", "read:fp16/rec:fp16"])
def test_torch_flush_re_solves_and_cached_fold_equals_it_where_read_is_anchor(policy):
    """On the torch path the flush re-solves the corrections against A for every policy (as
    the window form does: stepping and teacher forcing give the same bits, DESIGN.md "one
    flush routine for both paths"); ``GDNFold.folds_cached`` says so (``kernels=False``), and
    says the kernels fold the cached ones where R is A. Where R is A the cached read-path
    corrections (the step reference's, row by row) solve the same system: their fold is within
    float reassociation of the re-solve. Oracles: the flush-token output (from the unrounded
    flushed S) against ``gdn_flush`` with RECOMPUTE bit for bit; both folds against the
    float64 recurrence from the same anchor. (The kernels' side:
    ``test_state_kernels_fold_cached_corrections_where_read_is_anchor``.)"""
    from replayssm_quant.config import GDNFold
    from replayssm_quant.policy import StatePolicy
    from replayssm_quant.replay import core, gdn_flush, gdn_step_output

    L = 6
    inp = M.inputs(T=L, dtype=torch.float32, seed=21)
    S0 = torch.randn(M.state_shape(inp), generator=torch.Generator().manual_seed(5))
    st = M.state(inp, policy, window=L, seed=7, backend="torch")
    st.prefill(S0)
    A0 = st.anchor
    y = run_steps(st, M.tok, inp, L)[:, L - 1]  # the last token flushes: S q
    pol = StatePolicy.parse(policy)
    assert not GDNFold.RECOMPUTE.folds_cached(pol, kernels=False)
    assert GDNFold.RECOMPUTE.folds_cached(pol, kernels=True) == pol.single_checkpoint
    assert GDNFold.CACHED.folds_cached(pol, kernels=False)
    # the read-path corrections as the torch step reference solves and caches them
    B, HV, DV = A0.shape[:3]
    u = torch.zeros(B, L, HV, DV)
    for t in range(L):
        _, u = gdn_step_output(A0, inp["g"], inp["beta"], inp["v"], inp["k"], inp["q"][:, t],
                               u, torch.full((B,), t + 1))
    kw = dict(seed=7, layer=0, sequence_ids=torch.arange(B), flush_index=torch.ones(B, dtype=torch.int64))
    args = (A0, inp["g"], inp["beta"], inp["v"], inp["k"], pol)
    S_cached = gdn_flush(*args, u_cached=u, fold=GDNFold.CACHED, **kw).state
    S_solved = gdn_flush(*args, fold=GDNFold.RECOMPUTE, **kw).state
    assert not torch.equal(S_cached, S_solved)  # the two folds differ in last bits here
    q = core.expand_heads(inp["q"][:, L - 1], HV, 1)
    assert torch.equal(y, core.matvec(S_solved, q)), policy
    # both folds are the recurrence from A0 up to float reassociation where R is A (a dual
    # policy's cached corrections were solved against R, not A)
    S64 = A0.double()
    for t in range(L):
        a = inp["g"][:, t].double().exp()[:, :, None, None]
        k = core.expand_heads(inp["k"][:, t], HV, 1).double()
        uu = inp["beta"][:, t].double()[:, :, None] * (
            inp["v"][:, t].double() - (a * S64 @ k[..., None])[..., 0])
        S64 = a * S64 + uu[..., None] * k[:, :, None, :]
    assert rel_err(S_solved.double(), S64) < 1e-6
    if pol.single_checkpoint:
        assert rel_err(S_cached.double(), S64) < 1e-6


def test_corrections_solve_matches_sequential_delta_rule():
    """The triangular solve equals the corrections of the materialised recurrence."""
    from replayssm_quant.replay import core

    inp = M.inputs(T=7, B=2, HK=2, HV=4, seed=10)
    S0 = torch.randn(2, 4, 8, 32, dtype=torch.float64)
    k = core.expand_heads(inp["k"], 4, 2)
    u = core.solve_corrections(S0, inp["g"], inp["beta"], inp["v"], k)
    S, us = S0, []
    for t in range(7):
        a = torch.exp(inp["g"][:, t])[..., None]
        ut = inp["beta"][:, t, :, None] * (inp["v"][:, t] - a * core.matvec(S, k[:, t]))
        S = a[..., None] * S + ut[..., None] * k[:, t, :, None, :]
        us.append(ut)
    assert rel_err(u, torch.stack(us, 1)) < 1e-12
    assert rel_err(core.reconstruct(S0, inp["g"], u, k), S) < 1e-12


def test_rmse_ordering_512_steps():
    C.check_rmse_ordering("gdn")


@pytest.mark.parametrize("bad", ["false", 0, 1, None])
def test_fold_cached_corrections_must_be_a_bool(bad):
    """A string or int is refused by name, not coerced (bool("false") is True)."""
    from replayssm_quant.replay.gdn import GDNReplayState

    with pytest.raises(ValueError, match=r"fold_cached_corrections must be True or False"):
        GDNReplayState("shared:fp16", batch=1, key_heads=1, value_heads=1, key_dim=32,
                       value_dim=8, fold_cached_corrections=bad)
    for ok in (False, True):
        st = GDNReplayState("shared:fp16", batch=1, key_heads=1, value_heads=1, key_dim=32,
                            value_dim=8, fold_cached_corrections=ok)
        assert st.fold_cached_corrections is ok
