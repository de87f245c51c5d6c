"""Policy maps (issue 18, item 1): parsing, resolution, per-head casts, and whole-model identities
on the embedded models (a map that overrides nothing is bit-identical to its default; one
overridden layer or head group changes that state only)."""

import json

import pandas as pd
import pytest
import torch

from replayssm_quant.config import LayerwiseConfig, StateConfig
from replayssm_quant.policy import HeadPolicy, StatePolicy
from replayssm_quant.policymap import (DecayRule, IndexRange, PolicyMap, load_decay_stats,
                                       parse_state_arg)

P = StatePolicy.parse
NV = "read:nvfp4/rec:fp32"
HEADS = {0: 4, 1: 4, 2: 4, 4: 4, 5: 4}  # tiny-gdn's SSM layers (layer 3 is attention)


# ------------------------------------------------------------------------------ parsing
def test_json_compact_dict_agree_and_roundtrip(tmp_path):
    obj = {"default": NV, "layers": {"2": "shared:fp16", "0-1": "fp32"},
           "heads": {"4": {"0-1": "fp32", "3": "shared:bf16"}},
           "decay": [{"min_decay": 0.99, "policy": "read:fp8e4m3/rec:fp32"},
                     {"min_decay": 0.5, "max_decay": 0.9, "policy": "shared:nvfp4+sr"}]}
    f = tmp_path / "m.json"
    f.write_text(json.dumps(obj))
    from_file, from_dict = parse_state_arg(str(f)), parse_state_arg(obj)
    text = ("map:read:nvfp4/rec:fp32@L0-1=fp32@L2=shared:fp16@L4H0-1=fp32@L4H3=shared:bf16"
            "@D0.5-0.9=shared:nvfp4+sr@D0.99=read:fp8e4m3/rec:fp32")
    assert str(from_file) == str(from_dict) == text  # canonical: rules sorted
    assert from_file.name == "m" and from_dict.name is None  # a file's stem labels it
    assert from_file == from_dict == parse_state_arg(text) == parse_state_arg(text.upper())
    assert PolicyMap.from_dict(from_file.to_dict()) == from_file
    assert parse_state_arg(json.dumps(obj)) == from_dict
    assert parse_state_arg("shared:fp16") == P("shared:fp16")  # plain policies pass through
    assert parse_state_arg(from_file) is from_file


@pytest.mark.parametrize("bad,msg", [
    ({"layers": {"1": "fp32"}}, "missing 'default'"),
    ({"default": NV, "layer": {}}, "unknown key(s) 'layer'"),
    ({"default": "shared:nvfp5"}, "bad policy at policy map 'default'"),
    ({"default": NV, "layers": {"1": "read:x/rec:fp32"}}, "'layers' '1'"),
    ({"default": NV, "layers": {"a": "fp32"}}, "bad layer index"),
    ({"default": NV, "layers": {"3-1": "fp32"}}, "below its start"),
    ({"default": NV, "layers": {"0-2": "fp32", "2": "shared:fp16"}}, "layer ranges 0-2 and 2 overlap"),
    ({"default": NV, "heads": {"1": {"0-3": "fp32", "3-5": "fp32"}}}, "head ranges overlap"),
    ({"default": NV, "heads": {"1": {}}}, "non-empty object"),
    ({"default": NV, "decay": [{"min_decay": 0.5, "policy": "fp32"},
                               {"min_decay": 0.9, "policy": "fp32"}]}, "overlap"),
    ({"default": NV, "decay": [{"min_decay": 1.5, "policy": "fp32"}]}, "min_decay must be"),
    ({"default": NV, "decay": [{"min_decay": 0.5, "max_decay": 0.4, "policy": "fp32"}]},
     "max_decay must be"),
    ({"default": NV, "decay": [{"min": 0.5, "policy": "fp32"}]}, "'decay'[0]"),
    ([NV], "expected a JSON object"),
])
def test_bad_maps_name_the_problem(bad, msg):
    with pytest.raises(ValueError) as e:
        PolicyMap.from_dict(bad) if isinstance(bad, dict) else parse_state_arg(json.dumps(bad))
    assert msg in str(e.value)


@pytest.mark.parametrize("bad,msg", [
    ("map:", "bad policy"),
    ("map:fp32@X3=fp32", "bad rule key 'X3'"),
    ("map:fp32@L3", "expected KEY=POLICY"),
    ("map:fp32@L3=fp32,L4=fp32", "no commas"),
    ("map:fp32@D2=fp32", "min_decay must be"),
    ("{bad json", "bad policy map JSON"),
    ("nope/missing.json", "not found"),
    ("map:nope/missing.json", "'nope/missing.json' is a file name, not a policy; a policy map "
                              "file is given by its path alone, without 'map:'"),
    ("map:bogus", "bad state policy 'bogus'"),
])
def test_bad_compact_and_files(bad, msg):
    with pytest.raises(ValueError) as e:
        parse_state_arg(bad)
    assert msg in str(e.value)


def test_map_prefix_before_an_existing_file_says_to_drop_it(tmp_path):
    """``map:`` before a map file's path (a file without the .json suffix too) is refused with
    the fix; a dual policy, which holds a '/', is still a policy."""
    f = tmp_path / "layers.map"
    f.write_text(json.dumps({"default": "fp32"}))
    with pytest.raises(ValueError, match="is a file name, not a policy") as e:
        parse_state_arg(f"map:{f}")
    assert repr(str(f)) in str(e.value)
    m = parse_state_arg("map:read:nvfp4/rec:fp16+sr@L0=fp32")
    assert m.default == StatePolicy.parse("read:nvfp4/rec:fp16+sr")


def test_bad_json_file(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{\"default\": ")
    with pytest.raises(ValueError, match="is not valid JSON"):
        parse_state_arg(str(f))


# ------------------------------------------------------------------------------ resolution
def test_resolution_precedence_against_a_hand_table():
    m = PolicyMap.from_dict({
        "default": NV, "layers": {"1": "shared:fp16"},
        "heads": {"1": {"0": "fp32"}, "2": {"3": "shared:bf16"}},
        "decay": [{"min_decay": 0.9, "policy": "read:fp8e4m3/rec:fp32"}]})
    decay = {i: [0.5, 0.95, 0.2, 0.99] for i in HEADS}
    got = m.head_policies(HEADS, decay)
    fp8, f16, f32, bf = P("read:fp8e4m3/rec:fp32"), P("shared:fp16"), P("fp32"), P("shared:bf16")
    nv = P(NV)
    assert got[0] == [nv, fp8, nv, fp8]  # decay buckets, else default
    assert got[1] == [f32, f16, f16, f16]  # head rule > layer rule > decay
    assert got[2] == [nv, fp8, nv, bf]
    res = m.resolve(HEADS, decay)
    assert res[1] == HeadPolicy(((0, 1, f32), (1, 4, f16)))
    assert isinstance(res[2], HeadPolicy) and res[2].head_policies() == got[2]


def test_resolution_errors():
    with pytest.raises(ValueError, match="layer 3, which is not an SSM layer.*0 \\(4 heads\\)"):
        parse_state_arg("map:fp32@L3=shared:fp16").resolve(HEADS)
    with pytest.raises(ValueError, match="past the last SSM layer 5"):
        parse_state_arg("map:fp32@L4-9=shared:fp16").resolve(HEADS)
    with pytest.raises(ValueError, match="heads 2-4 of layer 1, which has 4 heads"):
        parse_state_arg("map:fp32@L1H2-4=shared:fp16").resolve(HEADS)
    with pytest.raises(ValueError, match="no head decays were given"):
        parse_state_arg("map:fp32@D0.9=shared:fp16").resolve(HEADS)
    with pytest.raises(ValueError, match="expected 4 values"):
        parse_state_arg("map:fp32@D0.9=shared:fp16").resolve(HEADS, {i: [0.5] for i in HEADS})
    with pytest.raises(ValueError, match="layer 1: a layer cannot mix eager"):
        parse_state_arg("map:shared:fp16@L1H0=eager:fp16").resolve(HEADS)
    # a range over a hybrid model covers the SSM layers in it
    assert parse_state_arg("map:fp32@L2-4=shared:fp16").resolve(HEADS)[4] == P("shared:fp16")


def test_head_policy_from_heads():
    a, b = P("fp32"), P("shared:nvfp4")
    assert HeadPolicy.from_heads([a, a, a]) is a
    hp = HeadPolicy.from_heads([a, a, b, a])
    assert hp.groups == ((0, 2, a), (2, 3, b), (3, 4, a)) and hp.heads == 4
    assert str(hp) == "heads[0-1=fp32|2=shared:nvfp4|3=fp32]" and not hp.uses_sr
    assert hp.single_checkpoint  # both groups keep one checkpoint
    with pytest.raises(ValueError, match="tile the heads"):
        HeadPolicy(((0, 2, a), (3, 4, b)))
    with pytest.raises(ValueError, match="at least two"):
        HeadPolicy(((0, 4, a),))
    with pytest.raises(TypeError):
        HeadPolicy.from_heads(["fp32"])


def test_index_range_and_decay_rule():
    assert IndexRange.parse("0-7") == IndexRange(0, 7) and str(IndexRange(3, 3)) == "3"
    r = DecayRule(0.9, 1.0, P("fp32"))
    assert r.contains(1.0) and r.contains(0.9) and not r.contains(0.899)
    assert DecayRule(0.5, 0.9, P("fp32")).contains(0.5) and not DecayRule(0.5, 0.9, P("fp32")).contains(0.9)


def test_load_decay_stats_formats(tmp_path):
    rows = {"decays": [{"layer": 1, "head": h, "mean": 0.1 * h} for h in range(3)]}
    f = tmp_path / "d.json"
    f.write_text(json.dumps(rows))
    assert load_decay_stats(str(f)) == {1: (0.0, 0.1, 0.2)} == load_decay_stats({"1": [0.0, 0.1, 0.2]})
    with pytest.raises(ValueError, match="heads \\[0, 2\\], expected 0..1"):
        load_decay_stats({"decays": [{"layer": 0, "head": 0, "mean": 0.5}, {"layer": 0, "head": 2, "mean": 0.5}]})
    with pytest.raises(ValueError, match="mean decay 1.5"):
        load_decay_stats({"0": [1.5]})


# ------------------------------------------------------------------------------ per-head casts
@pytest.mark.parametrize("sr", [False, True])
def test_head_policy_cast_equals_uniform_casts_slice_by_slice(sr):
    """Oracle: each head group's slice equals the uniform policy's cast of the full state."""
    from replayssm_quant.replay.core import cast_checkpoints

    s = "+sr" if sr else ""
    pa, pb, pc = P(f"read:nvfp4{s}/rec:fp16{s}"), P(f"shared:fp8e4m3{s}"), P("fp32")
    hp = HeadPolicy.from_heads([pa, pa, pb, pc, pa])
    g = torch.Generator().manual_seed(1)
    S = torch.randn(3, 5, 8, 32, generator=g)
    kw = dict(seed=7, layer=2, sequence_ids=torch.tensor([3, 9, 1]), flush_index=torch.tensor([4, 4, 5]))
    got = cast_checkpoints(S, hp, **kw)
    for pol, sl in ((pa, slice(0, 2)), (pb, slice(2, 3)), (pc, slice(3, 4)), (pa, slice(4, 5))):
        ref = cast_checkpoints(S, pol, **kw)
        assert torch.equal(got.anchor[:, sl], ref.anchor[:, sl])
        assert torch.equal(got.read[:, sl], ref.read[:, sl])
    stored = cast_checkpoints(S, hp, store=True, **kw)
    assert len(stored.anchor_stored) == 4 and torch.equal(stored.anchor, got.anchor)
    single = cast_checkpoints(S, HeadPolicy.from_heads([pb, pc, pc, pc, pb]), **kw)
    assert single.read is single.anchor


def test_state_objects_refuse_head_policies():
    from replayssm_quant.replay import Mamba2ReplayState

    hp = HeadPolicy.from_heads([P("fp32"), P("shared:fp16")])
    with pytest.raises(ValueError, match="per-head policy maps run through the adapters"):
        Mamba2ReplayState(hp, batch=1, heads=2, head_dim=4, d_state=16, window=4,
                          dtype=torch.float32, device="cpu")


# ------------------------------------------------------------------------------ whole models
@pytest.fixture(scope="module", params=["tiny-gdn", "tiny-mamba2"])
def embedded(request):
    from replayssm_quant.models import load_model

    model, tok = load_model(request.param, tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3))
    return request.param, model, ids


def _run(model, ids, policy, window=16):
    from replayssm_quant.adapters import state_policy

    with state_policy(model, policy, window=window, prefill=False) as h, torch.no_grad():
        out = model(ids, use_cache=True)
        return out.logits, h.states(out.past_key_values), h


@pytest.mark.parametrize("pol", ["read:nvfp4/rec:fp16+sr", "shared:fp8e4m3"])
def test_uniform_map_is_bit_identical(embedded, pol, tmp_path):
    name, model, ids = embedded
    ref, sref, _ = _run(model, ids, pol)
    f = tmp_path / "uniform.json"
    f.write_text(json.dumps({"default": pol}))
    # a map whose default is P and which overrides nothing, and one whose rules all say P
    every = "map:" + pol + "@" + "@".join(f"L{i}={pol}" for i in sref)
    for m in (str(f), "map:" + pol, every):
        got, sgot, h = _run(model, ids, m)
        assert isinstance(h.config, LayerwiseConfig)
        assert torch.equal(got, ref), (name, m)
        for i in sref:
            assert torch.equal(sgot[i].anchor, sref[i].anchor) and torch.equal(sgot[i].read, sref[i].read)


def test_one_layer_overridden(embedded):
    """Overriding the last SSM layer leaves every other layer's A and R bit-identical to the
    default run (their inputs are the same); overriding the first one makes its state equal to
    the uniform run of the override (same inputs, same streams); head groups likewise."""
    name, model, ids = embedded
    d, q = "read:nvfp4/rec:fp32", "shared:fp8e4m3+sr"
    ref, sd, _ = _run(model, ids, d)
    _, sq, _ = _run(model, ids, q)
    layers = sorted(sd)
    first, last = layers[0], layers[-1]
    got, s_last, h = _run(model, ids, f"map:{d}@L{last}={q}")
    assert h.config.for_layer(last).policy == P(q) and h.config.for_layer(first).policy == P(d)
    assert not torch.equal(got, ref)
    for i in layers[:-1]:
        assert torch.equal(s_last[i].anchor, sd[i].anchor) and torch.equal(s_last[i].read, sd[i].read)
    assert not torch.equal(s_last[last].anchor, sd[last].anchor)
    _, s_first, _ = _run(model, ids, f"map:{d}@L{first}={q}")
    assert torch.equal(s_first[first].anchor, sq[first].anchor)
    assert torch.equal(s_first[first].read, sq[first].read)
    for i in layers[1:]:  # downstream of a changed layer: differs from both uniform runs
        assert not torch.equal(s_first[i].anchor, sd[i].anchor)
    # head groups of the first layer: each slice equals the uniform run of its policy
    H = sd[first].anchor.shape[1]
    _, s_head, h = _run(model, ids, f"map:{d}@L{first}H0-{H // 2 - 1}={q}")
    assert isinstance(h.config.for_layer(first).policy, HeadPolicy)
    lo, hi = slice(0, H // 2), slice(H // 2, H)
    assert torch.equal(s_head[first].anchor[:, lo], sq[first].anchor[:, lo])
    assert torch.equal(s_head[first].read[:, lo], sq[first].read[:, lo])
    assert torch.equal(s_head[first].anchor[:, hi], sd[first].anchor[:, hi])
    assert torch.equal(s_head[first].read[:, hi], sd[first].read[:, hi])


def test_decay_buckets_resolve_from_the_shipped_stats(embedded):
    """Oracle: the model card's per-head means (docs/models/<name>-stats.json)."""
    from pathlib import Path

    from replayssm_quant.adapters import apply_state_policy

    name, model, _ = embedded
    stats = json.loads((Path(__file__).parents[1] / "docs" / "models" / f"{name}-stats.json").read_text())
    h = apply_state_policy(model, "map:read:nvfp4/rec:fp32@D0.95=fp32")
    try:
        for r in stats["decays"]:
            pol = h.config.for_layer(r["layer"]).policy
            per = pol.head_policies() if isinstance(pol, HeadPolicy) else [pol] * 64
            assert per[r["head"]] == P("fp32" if r["mean"] >= 0.95 else NV), r
    finally:
        h.remove()


def test_measure_head_decay_matches_hooks(embedded):
    """Oracle: per-token decays from forward hooks on the raw projections, as the model card's
    script computes them (scripts/model_card_stats.py)."""
    import torch.nn.functional as F

    from replayssm_quant.adapters import find_ssm_mixers, measure_head_decay

    name, model, ids = embedded
    got = measure_head_decay(model, [ids[0, :64], ids[0, 64:]])
    seen: dict = {}
    hooks = []
    for _, mx, fam in find_ssm_mixers(model):
        if fam == "gdn":
            def hook(mod, inp, out, mx=mx):
                g = -torch.exp(mx.A_log.double()) * F.softplus(out.double() + mx.dt_bias.double())
                seen.setdefault(mx.layer_idx, []).append(torch.exp(g).reshape(-1, mx.num_v_heads))
            hooks.append(mx.in_proj_a.register_forward_hook(hook))
        else:
            def hook(mod, inp, out, mx=mx):
                dt = F.softplus(out[..., -mx.num_heads:].double() + mx.dt_bias.double())
                a = torch.exp(dt * -torch.exp(mx.A_log.double()))
                seen.setdefault(mx.layer_idx, []).append(a.reshape(-1, mx.num_heads))
            hooks.append(mx.in_proj.register_forward_hook(hook))
    with torch.no_grad():
        model(ids[:, :64])
        model(ids[:, 64:])
    for hk in hooks:
        hk.remove()
    assert sorted(got) == sorted(seen)
    for i, v in seen.items():
        torch.testing.assert_close(torch.tensor(got[i], dtype=torch.float64), torch.cat(v).mean(0),
                                   rtol=1e-5, atol=1e-6)


def test_handle_set_policy_and_use(embedded):
    from replayssm_quant.adapters import apply_state_policy

    _, model, _ = embedded
    h = apply_state_policy(model, "fp32")
    try:
        h.set_policy("map:fp32@L0=shared:fp16", window=8)
        assert isinstance(h.config, LayerwiseConfig) and h.config.window == 8
        assert str(h.policy) == "map:fp32@L0=shared:fp16"
        with pytest.raises(ValueError, match="layer 99"):
            h.config.for_layer(99)
        h.use(StateConfig.build("shared:fp16"))
        assert h.policy == P("shared:fp16")
        with pytest.raises(ValueError, match="not an SSM layer"):
            h.set_policy("map:fp32@L99=fp32")
    finally:
        h.remove()


def test_kl_runner_uniform_map_identity_and_errors(tmp_path, capsys):
    """Through replayssm-kl on tiny-mamba2: P and the map {default: P} give identical rows;
    maps naming a missing layer exit 2 before compute."""
    from replayssm_quant.evals.kl import main

    out = tmp_path / "run"
    pol = "read:nvfp4/rec:fp16+sr"
    f = tmp_path / "u.json"
    f.write_text(json.dumps({"default": pol}))
    base = ["--model", "tiny-mamba2", "-N", "80", "--max-docs", "2", "--segment-len", "48",
            "--stepwise-check", "0", "--no-progress", "-o", str(out)]
    assert main(base + ["--policies", pol, str(f)]) == 0
    pos = pd.read_parquet(out / "positions.parquet")
    a = pos[pos.policy == pol].reset_index(drop=True)
    b = pos[pos.policy == "map:" + pol].reset_index(drop=True)
    assert len(a) == 160 and a["kl"].mean() > 0
    pd.testing.assert_frame_equal(a.drop(columns="policy"), b.drop(columns="policy"))
    man = json.loads((out / "manifest.json").read_text())
    assert man["policy_maps"]["map:" + pol]["name"] == "u"
    capsys.readouterr()
    assert main(base + ["--policies", "map:fp32@L1=shared:fp16"]) == 2
    assert "layer 1, which is not an SSM layer" in capsys.readouterr().err
    # the work and memory plan take map cells before the model loads (--dry-run)
    assert main(base + ["--policies", "map:fp32@L2=read:nvfp4/rec:fp16", "--dry-run"]) == 0
    assert "map:fp32@L2=read:nvfp4/rec:fp16 L=16" in capsys.readouterr().out


def test_results_accept_map_labels():
    from replayssm_quant.analysis.results import policy_parts

    assert policy_parts("map:fp32@L0=shared:fp16") == ("map", "", "")
    assert policy_parts("shared:fp16") == ("shared", "fp16", "fp16")


def test_lm_eval_state_takes_maps(tmp_path):
    """lm-eval ``state=map.json``: checked before loading, resolved per layer, and a uniform map
    scores exactly like its default policy."""
    from lm_eval.api.instance import Instance

    from replayssm_quant.evals.lm_eval_adapter import ReplaySSMLM, check_model_args

    f = tmp_path / "m.json"
    f.write_text(json.dumps({"default": "shared:nvfp4", "layers": {"0": "fp32"}}))
    u = tmp_path / "u.json"
    u.write_text(json.dumps({"default": "shared:nvfp4"}))
    check_model_args(f"pretrained=tiny-gdn,state={f}")
    with pytest.raises(ValueError, match="state='map:fp32@Q1=fp32'.*bad rule key"):
        check_model_args("pretrained=tiny-gdn,state=map:fp32@Q1=fp32")
    with pytest.raises(ValueError, match="decay_stats='nope.json'"):
        check_model_args("pretrained=tiny-gdn,decay_stats=nope.json")
    reqs = [("And God said", " Let there be light"), ("In the beginning", " God created the heaven")]

    def ll(state):
        lm = ReplaySSMLM(pretrained="tiny-gdn", device="cpu", batch_size=1, state=state, window=4)
        out = [r[0] for r in lm.loglikelihood([Instance("loglikelihood", {}, q, i)
                                               for i, q in enumerate(reqs)], disable_tqdm=True)]
        return lm, out

    lm, mapped = ll(str(f))
    assert lm.handle.config.for_layer(0).policy == P("fp32")
    assert lm.handle.config.for_layer(1).policy == P("shared:nvfp4")
    assert lm.get_model_info()["replayssm_state"] == "map:shared:nvfp4@L0=fp32"
    assert ll(str(u))[1] == ll("shared:nvfp4")[1] != mapped


def test_head_decays_out_of_range_or_not_numbers_are_refused():
    """Decays given straight to ``head_policies`` / ``resolve`` are checked as
    ``load_decay_stats`` checks a file's: a NaN would match no bucket and a value above 1 the
    top one, silently. Non-numbers name their source."""
    pm = parse_state_arg("map:fp32@D0.5-0.9=shared:nvfp4+sr")
    ok = {0: [0.1, 0.6, 0.95]}
    assert [str(p) for p in pm.head_policies({0: 3}, ok)[0]] == ["fp32", "shared:nvfp4+sr", "fp32"]
    for bad, word in (([0.1, float("nan"), 0.5], "head 1 has mean decay nan"),
                      ([0.1, 1.5, 0.5], "head 1 has mean decay 1.5"),
                      ([-1.0, 0.5, 0.5], "head 0 has mean decay -1.0")):
        with pytest.raises(ValueError, match=word):
            pm.head_policies({0: 3}, {0: bad})
    with pytest.raises(ValueError, match="lists of floats"):
        pm.head_policies({0: 3}, {0: ["x", 0.5, 0.5]})
    with pytest.raises(ValueError, match="not numbers"):
        load_decay_stats({"decays": [{"layer": 0, "head": 0, "mean": "a"}]})
