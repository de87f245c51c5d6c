"""Teacher-forced emulation equals stepping through the patched model (issue 4).

Float64 models (DESIGN.md testing note: the two paths add in different orders; in float64 the
reassociation error is far too small to flip a rounding decision), window L = 4, a prefill,
then more than 3 windows plus a partial one split into two segments (the boundary falls
mid-window), versus one token per call. Same random bits under SR: max |logit diff| <= 1e-4.
"""

import pytest
import torch

from replayssm_quant.adapters import apply_state_policy
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.adapters.tiny import TINY_ARCHITECTURES, TINY_VOCAB, tiny_model

TOL = 1e-4
POLICIES = ("shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr", "eager:fp8e4m3")
L, P = 4, 5
N = P + 3 * L + 3  # prefill + 3 full windows + a partial one


def _ids(B, T, seed=0):
    return torch.randint(3, TINY_VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _emulate(model, ids, cut):
    l0, c = forward_segment(model, ids[:, :P])
    l1, c = forward_segment(model, ids[:, P:cut], c, start=P)
    l2, c = forward_segment(model, ids[:, cut:], c, start=cut)
    return torch.cat([l0, l1, l2], 1), c


def _step(model, ids):
    out, c = forward_segment(model, ids[:, :P])
    outs = [out]
    for i in range(P, ids.shape[1]):
        lg, c = forward_segment(model, ids[:, i:i + 1], c, start=i)
        outs.append(lg)
    return torch.cat(outs, 1), c


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_emulation_equals_stepping(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(2, N)
    with torch.no_grad():
        for pol in POLICIES:
            with apply_state_policy(model, pol, window=L, seed=3) as h:
                em, ce = _emulate(model, ids, cut=P + 7)
                st, cs = _step(model, ids)
                ref_h = h
            assert (em - st).abs().max().item() <= TOL, pol
            # the checkpoints agree too, and the runs really went through several flushes
            se, ss = ref_h.states(ce), ref_h.states(cs)
            assert se.keys() == ss.keys() and se
            for i in se:
                assert se[i].flushes == ss[i].flushes >= 3
                assert (se[i].anchor - ss[i].anchor).abs().max().item() < 1e-9


def test_policies_differ_and_fp32_emulation_matches_reference():
    model = tiny_model("olmo_hybrid", dtype=torch.float64)
    ids = _ids(1, N)
    with torch.no_grad():
        ref = model(ids).logits
        res = {}
        for pol in ("fp32",) + POLICIES:
            with apply_state_policy(model, pol, window=L, seed=3, prefill=False):
                res[pol], _ = _emulate(model, ids, cut=P + 7)
    # the unpatched model runs its SSM kernels in float32 even for a float64 model
    assert (res["fp32"] - ref).abs().max().item() <= TOL
    for pol in POLICIES:
        assert (res[pol] - ref).abs().max().item() > 1e-3, pol


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_next"])
def test_batch_independence(arch):
    """A sequence's results do not change when other sequences join the batch (SR streams are
    keyed by sequence id, not batch row). Float64, so batched matmuls cannot flip a rounding."""
    model = tiny_model(arch, dtype=torch.float64)
    ids = _ids(3, 20, seed=1)
    pol = "read:nvfp4+sr/rec:fp8e4m3+sr"
    with torch.no_grad():
        with apply_state_policy(model, pol, window=4, seed=5, sequence_ids=[7]):
            alone, _ = _emulate(model, ids[1:2], cut=11)
        with apply_state_policy(model, pol, window=4, seed=5, sequence_ids=[3, 7, 9]):
            batch, _ = _emulate(model, ids, cut=11)
        with apply_state_policy(model, pol, window=4, seed=5, sequence_ids=[3, 8, 9]):
            other, _ = _emulate(model, ids, cut=11)
    assert (batch[1] - alone[0]).abs().max().item() <= 1e-6
    assert (other[1] - alone[0]).abs().max().item() > 1e-4  # a different id draws other bits


def test_generate_under_policy_and_cached_fold_variant():
    model = tiny_model("qwen3_5")
    ids = _ids(2, 6)
    with torch.no_grad():
        with apply_state_policy(model, "shared:nvfp4+sr", window=3, gdn_fold="cached"):
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 14)


def test_cached_fold_reaches_the_gdn_states():
    """gdn_fold="cached" through the adapters: under a dual policy (where the two folds
    differ: the cached read-path corrections carry the NVFP4 read copy's error into the
    anchor) emulation still equals stepping, and the anchors differ from the default
    (recompute) fold's after the flushes, so the option reaches every GDN layer's state."""
    from replayssm_quant.config import GDNFold

    model = tiny_model("qwen3_5", dtype=torch.float64)
    ids = _ids(2, N)
    pol = "read:nvfp4/rec:fp32"
    anchors = {}
    with torch.no_grad():
        for fold in ("cached", "recompute"):
            with apply_state_policy(model, pol, window=L, seed=3, gdn_fold=fold) as h:
                assert h.gdn_fold is GDNFold(fold)
                em, ce = _emulate(model, ids, cut=P + 7)
                st, cs = _step(model, ids)
                se, ss = h.states(ce), h.states(cs)
            assert (em - st).abs().max().item() <= TOL, fold
            assert se and se.keys() == ss.keys()
            for i in se:
                assert se[i].flushes == ss[i].flushes >= 3
                assert (se[i].anchor - ss[i].anchor).abs().max().item() < 1e-9
            anchors[fold] = se
    for i in anchors["cached"]:
        d = (anchors["cached"][i].anchor - anchors["recompute"][i].anchor).abs().max().item()
        assert d > 1e-6, (i, d)


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_state_path_ignores_autocast(arch, monkeypatch):
    """Under torch.autocast (HFLM's mixed_precision_dtype) the projections run in bfloat16 as
    in the unpatched model, but the state path keeps its own precision: each layer's
    recurrence outputs (exact prefill and the policy's windows) equal, bit for bit, those of
    the same inputs and starting state run again here without autocast. Before, the torch
    path's products ran in bfloat16 and `fp32` was not FP32-state decoding."""
    import replayssm_quant.adapters as A
    import replayssm_quant.adapters.state as S

    seen = []  # ("prefill", inp, o) / ("advance", S0, kwargs, inp, o)
    orig_prefill, orig_init, orig_adv = A.prefill_scan, S.LayerState.__init__, S.LayerState.advance

    def prefill(family, inp, *a, **k):
        o, st = orig_prefill(family, inp, *a, **k)
        seen.append(("prefill", family, {n: v.clone() for n, v in inp.items()}, o.clone()))
        return o, st

    def init(self, S0, **kw):
        orig_init(self, S0, **kw)
        self._audit = (S0.clone(), kw)

    def advance(self, inp):
        o = orig_adv(self, inp)
        seen.append(("advance", self._audit, {n: v.clone() for n, v in inp.items()}, o.clone()))
        return o

    monkeypatch.setattr(A, "prefill_scan", prefill)
    monkeypatch.setattr(S.LayerState, "__init__", init)
    monkeypatch.setattr(S.LayerState, "advance", advance)
    model = tiny_model(arch)  # float32
    ids = _ids(2, N)
    runs = (("fp32", True), ("read:nvfp4/rec:fp16+sr", False))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = []
            for pol, prefill_flag in runs:
                with apply_state_policy(model, pol, window=L, seed=3, prefill=prefill_flag):
                    auto.append(forward_segment(model, ids)[0].float())
        n_auto = len(seen)
        with apply_state_policy(model, "fp32", window=L, seed=3):
            plain = forward_segment(model, ids)[0].float()
    del seen[n_auto:]
    assert (auto[0] - plain).abs().max().item() > 1e-3  # autocast did act on the model
    kinds = {s[0] for s in seen}
    assert kinds == {"prefill", "advance"}, kinds
    with torch.no_grad():
        for rec in seen:
            if rec[0] == "prefill":
                _, family, inp, o = rec
                again, _ = orig_prefill(family, inp)
            else:
                _, (S0, kw), inp, o = rec
                st = S.LayerState.__new__(S.LayerState)
                orig_init(st, S0.clone(), **kw)
                again = orig_adv(st, inp)
            assert o.dtype == again.dtype == torch.float32
            assert torch.equal(o, again), (rec[0], (o - again).abs().max().item())


def test_generate_without_cache_refused_under_exact_prefill():
    """generate(use_cache=False) re-runs the whole sequence as a fresh exact prefill for every
    token, so under prefill=True the policy would never act: refused, by keyword and through
    a generation config. With prefill=False each call emulates the sequence under the policy,
    which is allowed and really rounds. Removing the patch restores the class's generate."""
    from transformers import GenerationConfig

    model = tiny_model("qwen3_5")
    ids = _ids(1, 6)
    gen = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        with apply_state_policy(model, "fp32", window=4, prefill=False):  # FP32 state
            plain = model.generate(ids, use_cache=False, output_logits=True,
                                   return_dict_in_generate=True, **gen)
        with apply_state_policy(model, "eager:fp8e4m3", window=4):
            with pytest.raises(ValueError, match="use_cache=False"):
                model.generate(ids, use_cache=False, **gen)
            with pytest.raises(ValueError, match="use_cache=False"):
                model.generate(ids, generation_config=GenerationConfig(use_cache=False, **gen))
            with pytest.raises(ValueError, match="use_cache=False"):  # by position
                model.generate(ids, GenerationConfig(use_cache=False, **gen))
            model.generation_config.use_cache = False  # the model's own config
            with pytest.raises(ValueError, match="use_cache=False"):
                model.generate(ids, **gen)
            model.generation_config.use_cache = True
            assert model.generate(ids, **gen).shape == (1, 10)  # the default keeps a cache
        assert "generate" not in model.__dict__ and "_replayssm_handle" not in model.__dict__
        with apply_state_policy(model, "eager:fp8e4m3", window=4, prefill=False):
            out = model.generate(ids, use_cache=False, output_logits=True,
                                 return_dict_in_generate=True, **gen)
    d = max((a - b).abs().max().item() for a, b in zip(plain.logits, out.logits))
    assert d > 1e-3, d  # the policy acted


def test_guarded_generate_follows_a_deep_copy_and_yields_to_later_patches():
    """The guard is a method of the model it was applied to: a deep copy of the patched
    model generates with the copy's weights (and its own guard), and remove() leaves a
    generate that someone patched in after the policy alone."""
    import copy

    model = tiny_model("qwen3_5")
    ids = _ids(1, 6)
    gen = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        with apply_state_policy(model, "fp32", window=4):
            twin = copy.deepcopy(model)
            for p in twin.parameters():
                p.add_(0.05 * torch.randn_like(p))
            ours = model.generate(ids, **gen)
            theirs = twin.generate(ids, **gen)
            assert torch.equal(theirs, type(twin).generate(twin, ids, **gen))
            assert not torch.equal(ours, theirs)
            with pytest.raises(ValueError, match="use_cache=False"):
                twin.generate(ids, use_cache=False, **gen)
        h = apply_state_policy(model, "fp32", window=4)
        later = lambda *a, **k: "later"  # noqa: E731
        model.generate = later
        h.remove()
        assert model.generate is later


@pytest.mark.parametrize("decode", ["window", "serving"])
def test_window_beyond_memory_refused_by_name(decode):
    """A window whose records cannot fit the machine is refused with a ValueError naming it,
    before anything is allocated (the allocator's own error names no argument, and a lazily
    granted allocation can get the process killed while it writes the zeros)."""
    model = tiny_model("qwen3_5")
    match = r"window.*=1000000000000.* GiB on cpu, more than"
    # refused when applied: the window form's L x L matrices, or (serving) the decode
    # state's record ring of one sequence
    with pytest.raises(ValueError, match=match):
        apply_state_policy(model, "shared:fp16", window=10**12, decode=decode)
    assert not hasattr(model, "_replayssm_handle")  # nothing was patched
    if decode == "serving":  # and at the first generate, for a batch whose ring cannot fit
        import replayssm_quant.adapters as A

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(A.StatePolicyHandle, "_check_window_memory", lambda self, config: None)
            with torch.no_grad(), apply_state_policy(model, "shared:fp16", window=10**12,
                                                     decode=decode):
                with pytest.raises(ValueError, match=match):
                    model.generate(_ids(1, 6), max_new_tokens=2, do_sample=False)


def test_window_whose_matrices_exceed_memory_refused_by_name():
    """A window whose padded records fit but whose L x L decay and solve matrices cannot is
    refused by name too, before they are built: when the policy is applied (even one
    sequence's matrices would not fit), and, for a window that fits one sequence, at the
    call whose batch does not (checked here with the patch-time check bypassed)."""
    from replayssm_quant.capabilities import device_memory_bytes

    total = device_memory_bytes(torch.device("cpu"))
    if total is None:
        pytest.skip("this machine's memory size cannot be read")
    model = tiny_model("qwen3_5")
    L = 1 << 22  # 4M: records of a few hundred MiB, matrices of terabytes
    match = rf"window L={L}: the window form's L x L decay"
    with pytest.raises(ValueError, match=match + r".*\(1 sequence\(s\) x 4 heads\)"):
        apply_state_policy(model, "shared:fp16", window=L)
    # eager layers run with window 1 (a map too); switching to such a window is refused
    for pol in ("eager:fp16", "map:eager:fp16"):
        apply_state_policy(model, pol, window=L).remove()
    h = apply_state_policy(model, "shared:fp16", window=4)
    with pytest.raises(ValueError, match=match):
        h.set_policy("shared:fp16", window=L)
    with pytest.raises(ValueError, match=match):
        h.use(h.build_config("map:eager:fp16@L0=shared:fp16", window=L))
    assert h.window == 4 and h.config.window == 4  # the refused switch changed nothing
    h.set_policy("eager:fp16", window=L)  # fine: eager runs with window 1
    with pytest.raises(ValueError, match=match + r".*\(the window set earlier, kept since "
                                               r"set_policy\(\) was given none"):
        h.set_policy("shared:fp16")  # inherits L
    h.remove()
    import replayssm_quant.adapters as A

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A.StatePolicyHandle, "_check_window_memory", lambda self, config: None)
        with torch.no_grad(), apply_state_policy(model, "shared:fp16", window=L):
            with pytest.raises(ValueError, match=match):
                model.generate(_ids(1, 6), max_new_tokens=2, do_sample=False)
