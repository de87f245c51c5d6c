"""What ``replayssm-kl`` guarantees (issue 12), each against an independent oracle.

KL >= 0 (float64 oracle on the same logits), non-finite values on either side (NaN injected
into the reference or policy logits), BOS (the tokenizer's own ``add_special_tokens``
output), the stepwise check (token-by-token decoding done here with the adapters), repeated
windows / seeds / policies / documents (exit 2).
"""

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

import replayssm_quant.adapters as adapters
import replayssm_quant.adapters.segments as segments
from replayssm_quant.evals.kl import main, position_metrics
from replayssm_quant.models import EMBEDDED_MODELS


def _args(model_dir, data_file, out, *extra, policies=("shared:nvfp4+sr", "eager:fp8e4m3")):
    return ["--model", model_dir, "--dataset", data_file, "--max-tokens", "24", "--segment-len",
            "10", "--prefill", "3", "--windows", "4", "--max-docs", "2", "--batch-size", "2",
            "--policies", *policies, "-o", str(out), "--no-progress", *extra]


class Spy:
    """Records every model call of the runner (policy, start, input ids ``[B, T]``; the runner
    goes through ``segments.forward_each``) and can overwrite logits of a batch row."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.inject = []  # (policy predicate, batch row, position, value)
        self.policy = None
        orig_fe = segments.forward_each
        orig_sp = adapters.StatePolicyHandle.set_policy
        orig_use = adapters.StatePolicyHandle.use
        spy = self

        def set_policy(handle, policy, **kw):
            orig_sp(handle, policy, **kw)
            spy.policy = str(handle.policy)

        def use(handle, config):
            orig_use(handle, config)
            spy.policy = str(handle.policy)

        def forward_each(model, input_ids, caches=None, *, start=0, **kw):
            logits, caches = orig_fe(model, input_ids, caches, start=start, **kw)
            spy.calls.append((spy.policy, start, input_ids.detach().clone()))
            for pred, row, pos, value in spy.inject:
                if pred(spy.policy) and start <= pos < start + input_ids.shape[1]:
                    logits = logits.clone()
                    logits[row, pos - start, 5] = value
            return logits, caches

        monkeypatch.setattr(adapters.StatePolicyHandle, "set_policy", set_policy)
        monkeypatch.setattr(adapters.StatePolicyHandle, "use", use)
        monkeypatch.setattr(segments, "forward_each", forward_each)


# ------------------------------------------------------------------------------ 6: KL >= 0
def _oracle_kl(ref, pol):
    """Textbook sum p (log p - log q) in float64 (for runner-level comparisons)."""
    lr = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(pol.double(), -1)
    return (lr.exp() * (lr - lq)).sum(-1).numpy()


def _oracle_kl_extended(ref, pol):
    """The same in numpy long double (x87 80-bit on x86-64: 11 more bits than float64), accurate
    to ~1e-18 nats, so float64 rounding of the runner's KL is resolvable."""
    def log_softmax(x):
        x = x.numpy().astype(np.longdouble)
        m = x.max(-1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))
    lr, lq = log_softmax(ref), log_softmax(pol)
    return (np.exp(lr) * (lr - lq)).sum(-1)


@pytest.mark.parametrize("scale", [1e-7, 1e-5, 1e-3, 1.0])
def test_kl_is_float64_and_never_negative(scale):
    """Near-identical logits are where FP32 KL went negative (issue 12, item 6): the runner's KL
    must equal an extended-precision KL computed here to float64 rounding and never be below 0
    (a plain float64 sum p (log p - log q) is not enough: at scale 1e-7 it goes to -1e-15)."""
    if np.finfo(np.longdouble).eps > 1e-18:
        pytest.skip("numpy long double is not extended precision on this platform")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 256, 2048, generator=g) * 3
    pol = ref + scale * torch.randn(ref.shape, generator=g)
    tgt = torch.randint(0, 2048, (4, 256), generator=g)
    m = position_metrics(ref, pol, tgt)
    want = _oracle_kl_extended(ref, pol).astype(np.float64)
    assert m["kl"].dtype == np.float64
    assert (m["kl"] >= 0).all()
    np.testing.assert_allclose(m["kl"], want, rtol=1e-6, atol=1e-17)


def test_kl_exact_zero_and_extreme_logits():
    ref = torch.randn(3, 64)
    m = position_metrics(ref, ref.clone(), torch.zeros(3, dtype=torch.int64))
    assert (m["kl"] == 0).all()
    # one side puts ~all mass where the other has log-prob ~ -1000 (expm1 would overflow)
    ref = torch.zeros(2, 8)
    ref[:, 0] = 1000.0
    pol = torch.zeros(2, 8)
    pol[:, 1] = 1000.0
    m = position_metrics(ref, pol, torch.zeros(2, dtype=torch.int64))
    want = _oracle_kl(ref, pol)
    assert np.isfinite(m["kl"]).all() and (m["kl"] >= 0).all()
    np.testing.assert_allclose(m["kl"], want, rtol=1e-12)
    back = position_metrics(pol, ref, torch.zeros(2, dtype=torch.int64))
    np.testing.assert_allclose(back["kl"], _oracle_kl(pol, ref), rtol=1e-12)


def _oracle_metrics(ref, pol, tgt):
    """Per-position nll_ref, nll (nats), dp_ref = |P(target) - P_ref(target)| and top-1
    agreement, in numpy float64 from a hand-written log-softmax (max-shifted log-sum-exp)."""
    def log_softmax(x):
        x = np.asarray(x, dtype=np.float64)
        m = x.max(-1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))
    lr, lq = log_softmax(ref), log_softmax(pol)
    t = np.asarray(tgt)[..., None]
    lrt = np.take_along_axis(lr, t, -1)[..., 0]
    lqt = np.take_along_axis(lq, t, -1)[..., 0]
    return {"nll_ref": -lrt, "nll": -lqt, "dp_ref": np.abs(np.exp(lqt) - np.exp(lrt)),
            "top1_agree": np.asarray(ref).argmax(-1) == np.asarray(pol).argmax(-1)}


def test_nll_dp_and_top1_against_a_float64_oracle():
    """The other per-position columns, against numpy float64 on the same logits: NLLs in nats
    of the given targets, the absolute change of the target's probability, argmax agreement
    (the runner level is test_runner_metrics_follow_its_logits_and_next_tokens)."""
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(3, 50, 4096, generator=g) * 4
    pol = ref + 0.3 * torch.randn(ref.shape, generator=g)
    tgt = torch.randint(0, 4096, (3, 50), generator=g)
    m = position_metrics(ref, pol, tgt)
    want = _oracle_metrics(ref.numpy(), pol.numpy(), tgt.numpy())
    for k in ("nll_ref", "nll", "dp_ref"):
        assert m[k].dtype == np.float64
        np.testing.assert_allclose(m[k], want[k], rtol=1e-12, atol=1e-15, err_msg=k)
    assert (m["top1_agree"] == want["top1_agree"]).all()
    assert 0 < want["top1_agree"].mean() < 1  # both outcomes occur


def test_runner_metrics_follow_its_logits_and_next_tokens(model_dir, data_file, tmp_path,
                                                           monkeypatch):
    """positions.parquet's nll_ref, nll, dp_ref and top1_agree at position p are those of the
    logits the runner's model calls returned at p (the reference's and the policy's), with the
    document's token p + 1 as the target: recomputed here from the recorded calls."""
    calls = []  # (policy, start, input ids [B, T], logits [B, T, V])
    orig_fe = segments.forward_each
    orig_use = adapters.StatePolicyHandle.use
    current = {}

    def use(handle, config):
        orig_use(handle, config)
        current["policy"] = str(handle.policy)

    def forward_each(model, input_ids, caches=None, *, start=0, **kw):
        logits, caches = orig_fe(model, input_ids, caches, start=start, **kw)
        calls.append((current.get("policy"), start, input_ids.clone(), logits.detach().clone()))
        return logits, caches

    monkeypatch.setattr(adapters.StatePolicyHandle, "use", use)
    monkeypatch.setattr(segments, "forward_each", forward_each)
    out = tmp_path / "m"
    assert main(_args(model_dir, data_file, out, "--stepwise-check", "0")) == 0
    pos = pd.read_parquet(out / "positions.parquet")
    docs = json.loads((out / "manifest.json").read_text())["data"]["documents"]
    whole = {}  # policy -> (ids [B, N], logits [B, N, V]) in start order, first call per start
    for pol in {c[0] for c in calls}:
        seen = {}
        for p, start, ids, lg in calls:
            if p == pol and start not in seen and ids.shape[0] == len(docs):
                seen[start] = (ids, lg)
        starts = sorted(seen)
        whole[pol] = (torch.cat([seen[s][0] for s in starts], 1),
                      torch.cat([seen[s][1] for s in starts], 1))
    assert "fp32" in whole and "shared:nvfp4+sr" in whole
    ids, ref = whole["fp32"]
    _, pol = whole["shared:nvfp4+sr"]
    N = ids.shape[1]
    checked = 0
    for b, doc in enumerate(docs):
        rows = pos[(pos.doc == doc) & (pos.policy == "shared:nvfp4+sr")].sort_values("position")
        rows = rows[rows.position < N - 1]  # the last target is not among the inputs
        p = rows.position.to_numpy()
        want = _oracle_metrics(ref[b, p].numpy(), pol[b, p].numpy(), ids[b, p + 1].numpy())
        for k in ("nll_ref", "nll", "dp_ref"):
            np.testing.assert_allclose(rows[k].to_numpy(), want[k], rtol=1e-9, atol=1e-12,
                                       err_msg=f"{doc} {k}")
        assert (rows["top1_agree"].to_numpy() == want["top1_agree"]).all()
        checked += len(rows)
    assert checked == 2 * (N - 1 - 3)  # every reported position but the last, both documents


# ------------------------------------------------------------------------------ 7: non-finite
def test_nonfinite_reference_and_policy_are_recorded(model_dir, data_file, tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    spy.inject.append((lambda p: p == "fp32", 0, 7, float("nan")))            # reference, doc 0
    spy.inject.append((lambda p: p == "eager:fp8e4m3", 1, 12, float("inf")))  # one policy, doc 1
    out = tmp_path / "nf"
    assert main(_args(model_dir, data_file, out)) == 0
    pos = pd.read_parquet(out / "positions.parquet")
    docs = list(dict.fromkeys(pos["doc"]))
    at_ref = (pos["doc"] == docs[0]) & (pos["position"] == 7)
    at_pol = (pos["doc"] == docs[1]) & (pos["position"] == 12) & (pos["policy"] == "eager:fp8e4m3")
    assert at_ref.sum() == 2 and at_pol.sum() == 1
    r = pos[at_ref]
    assert r["nonfinite"].all() and r["nonfinite_ref"].all() and not r["nonfinite_policy"].any()
    assert r["kl"].isna().all() and r["nll_ref"].isna().all() and r["nll"].notna().all()
    p = pos[at_pol]
    assert p["nonfinite"].all() and p["nonfinite_policy"].all() and not p["nonfinite_ref"].any()
    assert p["kl"].isna().all() and p["nll"].isna().all() and p["nll_ref"].notna().all()
    rest = pos[~at_ref & ~at_pol]
    assert not rest["nonfinite"].any() and rest["kl"].notna().all()
    summ = pd.read_csv(out / "summary.csv")
    assert summ["nonfinite_ref"].sum() == 2 and summ["nonfinite_policy"].sum() == 1
    assert summ["nonfinite"].sum() == 3
    man = json.loads((out / "manifest.json").read_text())
    assert man["nonfinite_ref_rows"] == 2 and man["nonfinite_policy_rows"] == 1
    assert man["nonfinite_rows"] == 3 and man["nonfinite_ref_positions"] == 1
    assert man["nonfinite_by_policy"]["eager:fp8e4m3"]["nonfinite_policy"] == 1


# ------------------------------------------------------------------------------ 8: BOS
@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory):
    """The embedded tiny-gdn with a tokenizer whose own default adds BOS (Llama-style)."""
    from transformers import AutoTokenizer

    src = EMBEDDED_MODELS["tiny-gdn"]
    d = tmp_path_factory.mktemp("bosgdn")
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        os.symlink(src / f, d / f)
    AutoTokenizer.from_pretrained(src, add_bos_token=True).save_pretrained(d)
    return str(d)


def _first_input(spy):
    policy, start, ids = spy.calls[0]
    assert policy == "fp32" and start == 0
    return ids[0].tolist()


@pytest.mark.parametrize("choice", ["auto", "false", "true"])
def test_bos_follows_the_tokenizer(bos_model_dir, data_file, tmp_path, monkeypatch, choice):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bos_model_dir)
    text = json.loads(open(data_file).readline())["text"]
    default = tok(text)["input_ids"]
    assert default[0] == tok.bos_token_id  # the premise: this tokenizer adds BOS by default
    want = {"auto": default, "true": default,
            "false": tok(text, add_special_tokens=False)["input_ids"]}[choice]
    spy = Spy(monkeypatch)
    out = tmp_path / choice
    args = ["--model", bos_model_dir, "--dataset", data_file, "-N", "12", "--max-docs", "1",
            "--policies", "shared:nvfp4", "-o", str(out), "--no-progress"]
    if choice != "auto":
        args += ["--add-bos-token", choice]
    assert main(args) == 0
    seen = _first_input(spy)
    assert seen == want[:len(seen)] and len(seen) == 12
    man = json.loads((out / "manifest.json").read_text())
    assert man["bos"]["add_bos_token"] == choice
    assert man["bos"]["documents_starting_with_bos"] == (0 if choice == "false" else 1)
    # another BOS choice in the same directory is another setting: refused before compute
    other = "false" if choice != "false" else "true"
    a2 = [x for x in args if x not in ("--add-bos-token", choice)] + ["--add-bos-token", other]
    assert main(a2) == 2


def test_bos_true_on_a_tokenizer_without_default_bos(data_file, tmp_path, monkeypatch):
    """Embedded tiny-gdn: its tokenizer adds no BOS by default; ``true`` adds it (as HFLM's
    add_bos_token=True does through from_pretrained)."""
    from transformers import AutoTokenizer

    path = str(EMBEDDED_MODELS["tiny-gdn"])
    text = json.loads(open(data_file).readline())["text"]
    spy = Spy(monkeypatch)
    base = ["--model", "tiny-gdn", "--dataset", data_file, "-N", "12", "--max-docs", "1",
            "--policies", "shared:nvfp4", "--stepwise-check", "0", "--no-progress"]
    assert main(base + ["-o", str(tmp_path / "auto")]) == 0
    assert _first_input(spy) == AutoTokenizer.from_pretrained(path)(text)["input_ids"][:12]
    spy.calls.clear()
    assert main(base + ["-o", str(tmp_path / "true"), "--add-bos-token", "true"]) == 0
    want = AutoTokenizer.from_pretrained(path, add_bos_token=True)(text)["input_ids"]
    assert want[0] == 0 and _first_input(spy) == want[:12]


def test_bos_true_without_tokenizer_exit_2(model_dir, data_file, tmp_path, capsys):
    assert main(_args(model_dir, data_file, tmp_path / "x", "--add-bos-token", "true")) == 2
    err = capsys.readouterr().err
    assert "--add-bos-token true" in err and "no usable tokenizer" in err


def _tokenizer_dir(tmp_path, name, tokenizer_json):
    """The embedded tiny-gdn's weights beside a given tokenizer.json (None: no tokenizer)."""
    src = EMBEDDED_MODELS["tiny-gdn"]
    d = tmp_path / name
    d.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        os.symlink(src / f, d / f)
    if tokenizer_json is not None:
        (d / "tokenizer_config.json").write_bytes((src / "tokenizer_config.json").read_bytes())
        (d / "tokenizer.json").write_text(tokenizer_json)
    return str(d)


def test_tokenizer_files_that_do_not_load_exit_2(data_file, tmp_path, capsys):
    """A tokenizer that is there but broken is an error naming the files, never the silent byte
    fallback (which is for directories without tokenizer files, and says so)."""
    bad = _tokenizer_dir(tmp_path, "bad", '{"garbage": 1')
    assert main(_args(bad, data_file, tmp_path / "x", "--dry-run")) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "do not load" in err and bad in err
    none = _tokenizer_dir(tmp_path, "none", None)
    assert main(_args(none, data_file, tmp_path / "y", "--dry-run")) == 0
    assert "no tokenizer files" in capsys.readouterr().err
    # a tokenizer whose ids pass the model's vocabulary (4096): an error, not the fallback
    from replayssm_quant.evals.kl.documents import BadTokenizer, load_tokenization

    with pytest.raises(BadTokenizer, match="outside the model's vocabulary of 8"):
        load_tokenization(str(EMBEDDED_MODELS["tiny-gdn"]), 8)
    assert load_tokenization(none, 4096).fallback.startswith(f"model {none!r} has no tokenizer")
    assert load_tokenization(str(EMBEDDED_MODELS["tiny-gdn"]), 4096).fallback is None


def test_model_directory_without_usable_weights_exit_2(data_file, tmp_path, capsys):
    """No weight file, or a truncated safetensors file: exit 2 naming it before any compute (a
    dry run, which plans from the config alone, notes it and goes on)."""
    src = EMBEDDED_MODELS["tiny-gdn"]
    none, cut = tmp_path / "none", tmp_path / "cut"
    for d in (none, cut):
        d.mkdir()
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            os.symlink(src / f, d / f)
    (cut / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:100])
    for d, want in ((none, "has a config but no weights"), (cut, "model.safetensors' do not open")):
        assert main(_args(str(d), data_file, tmp_path / "x")) == 2
        assert want in capsys.readouterr().err
        assert not (tmp_path / "x").exists()
        assert main(_args(str(d), data_file, tmp_path / "x", "--dry-run")) == 0
        assert want in capsys.readouterr().err


# ------------------------------------------------------------------------------ 11: stepwise
def test_stepwise_check_against_token_by_token_decoding(model_dir, data_file, tmp_path, monkeypatch):
    """kl_path = KL(stepping || emulation) per position equals what the adapters give when this
    test decodes the same cell token by token itself."""
    spy = Spy(monkeypatch)
    out = tmp_path / "sw"
    args = ["--model", model_dir, "--dataset", data_file, "-N", "24", "--segment-len", "24",
            "--windows", "4", "--max-docs", "1", "--stepwise-check", "10", "--policies",
            "eager:fp8e4m3", "shared:nvfp4+sr", "-o", str(out), "--no-progress"]
    assert main(args) == 0
    ids = _first_input(spy)
    # the stepping really is one forward call per token with the cache, for every cell and the
    # reference (so kl_path is not emulation against itself, even where both give the same bits)
    for pol in ("fp32", "eager:fp8e4m3", "shared:nvfp4+sr"):
        starts = [st for p, st, x in spy.calls if p == pol and x.shape[1] == 1]
        assert starts == list(range(10)), pol
    step = pd.read_parquet(out / "stepwise.parquet")
    assert len(step) == 2 * 10 and sorted(set(step["position"])) == list(range(10))
    monkeypatch.undo()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.tensor([ids])

    def logits(policy, window, stepwise):
        with adapters.state_policy(model, policy, window=window, seed=0, prefill=False,
                                   sequence_ids=[adapters.sequence_id(ids)]), torch.no_grad():
            if not stepwise:
                return segments.forward_segment(model, x[:, :24])[0][0, :10]
            cache, out_ = None, []
            for t in range(10):
                lg, cache = segments.forward_segment(model, x[:, t:t + 1], cache, start=t)
                out_.append(lg[0, -1])
            return torch.stack(out_)

    ref_e, ref_s = logits("fp32", 1, False), logits("fp32", 1, True)  # the reference runs with L = 1
    for pol in ("eager:fp8e4m3", "shared:nvfp4+sr"):
        e, s = logits(pol, 4, False), logits(pol, 4, True)
        got = step[step["policy"] == pol].sort_values("position")
        np.testing.assert_allclose(got["kl_path"], _oracle_kl(s, e), rtol=1e-6, atol=1e-13)
        np.testing.assert_allclose(got["kl_step"], _oracle_kl(ref_s, s), rtol=1e-6, atol=1e-13)
        np.testing.assert_allclose(got["kl"], _oracle_kl(ref_e, e), rtol=1e-6, atol=1e-13)
        np.testing.assert_allclose(got["kl_path_ref"], _oracle_kl(ref_s, ref_e), rtol=1e-6, atol=1e-13)
    # the positions table and the stepwise table agree on the emulated KL
    pos = pd.read_parquet(out / "positions.parquet")
    m = step.merge(pos, on=["doc", "position", "policy", "window", "seed"], suffixes=("", "_pos"))
    np.testing.assert_array_equal(m["kl"], m["kl_pos"])
    man = json.loads((out / "manifest.json").read_text())
    per = {r["policy"]: r for r in man["stepwise_check"]["per_policy"]}
    for pol, g in step.groupby("policy"):
        assert per[pol]["path_kl_mean"] == pytest.approx(g["kl_path"].mean(), rel=1e-12)
        assert per[pol]["kl_mean"] == pytest.approx(g["kl"].mean(), rel=1e-12)
    summ = pd.read_csv(out / "summary.csv")
    assert summ["path_n"].sum() == 2 * 10 and summ["path_kl_mean"].notna().any()


def test_stepwise_check_resume_and_bad_value(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(_args(model_dir, data_file, out, "--stepwise-check", "5")) == 0
    step = pd.read_parquet(out / "stepwise.parquet")
    assert main(_args(model_dir, data_file, out, "--stepwise-check", "5")) == 0
    assert json.loads((out / "manifest.json").read_text())["cells_computed_this_run"] == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out / "stepwise.parquet"), step)
    assert main(_args(model_dir, data_file, tmp_path / "b", "--stepwise-check", "22")) == 2
    assert "--stepwise-check must be in [0, max-tokens - prefill] = [0, 21], got 22" in capsys.readouterr().err


# ------------------------------------------------------------------------------ 12 and 15: repeats
@pytest.mark.parametrize("flag,values,needle", [
    ("--windows", ["4", "4"], "--windows repeats 4"),
    ("--seeds", ["0", "0"], "--seeds repeats 0"),
    ("--policies", ["fp32", "shared:fp32"], "'fp32' and 'shared:fp32' are both the policy 'fp32'"),
    ("--policies", ["read:fp32/rec:fp32", "fp32"], "'read:fp32/rec:fp32' and 'fp32' are both"),
])
def test_repeated_cells_exit_2(model_dir, data_file, tmp_path, capsys, flag, values, needle):
    args = [x for x in _args(model_dir, data_file, tmp_path / "rep") if x != "eager:fp8e4m3"]
    args += ["--seeds", "0"]
    k = args.index(flag)
    args[k + 1:k + 2] = values
    assert main(args) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


def test_repeated_documents_exit_2(model_dir, data_file, tmp_path, capsys):
    args = _args(model_dir, data_file, tmp_path / "rep")
    k = args.index("--dataset")
    args[k + 1:k + 2] = [data_file, data_file]
    args[args.index("--max-docs") + 1] = "6"
    assert main(args) == 2
    assert "occurs twice" in capsys.readouterr().err


def test_positions_and_buckets_of_a_multi_cell_run(model_dir, data_file, tmp_path):
    out = tmp_path / "multi"
    args = _args(model_dir, data_file, out, "--seeds", "0", "1")
    args[args.index("--windows") + 1:args.index("--windows") + 2] = ["4", "8"]
    assert main(args) == 0
    pos = pd.read_parquet(out / "positions.parquet")
    key = ["doc", "position", "policy", "window", "seed"]
    assert not pos.duplicated(key).any() and len(pos) == 2 * 2 * 2 * 2 * 21
    assert pos["position"].min() == 3 and pos["position"].max() == 23
    summ = pd.read_csv(out / "summary.csv")
    want = np.floor(np.log2(pos["position"] + 1)).astype(int)
    assert sorted(summ["bucket"].unique()) == sorted(want.unique())
    # a policy without SR is computed once: its other seeds' rows are copies, not counted
    sr = pos["policy"].str.contains("+sr", regex=False)
    assert (summ["n"].sum()) == len(pos[sr | (pos["seed"] == 0)])


def test_label_copies_counted_once_everywhere(model_dir, data_file, tmp_path, capsys):
    """A non-SR policy's rows for its other seeds are label copies: summary.csv, the
    manifest's stepwise summary and non-finite counts, and the printed table all count each
    computed row once (a helper's audit found the printed table and the manifest counting the
    copies: 2304 positions against summary.csv's 1152)."""
    out = tmp_path / "copies"
    assert main(_args(model_dir, data_file, out, "--seeds", "0", "1", "--stepwise-check",
                      "6")) == 0
    text = capsys.readouterr().out
    pos = pd.read_parquet(out / "positions.parquet")
    docs, reported = pos["doc"].nunique(), pos["position"].nunique()
    man = json.loads((out / "manifest.json").read_text())
    per = {r["policy"]: r for r in man["stepwise_check"]["per_policy"]}
    assert per["eager:fp8e4m3"]["positions"] == docs * 6  # one computed seed
    assert per["shared:nvfp4+sr"]["positions"] == docs * 6 * 2  # two computed seeds
    summ = pd.read_csv(out / "summary.csv")
    n = summ.groupby("policy")[["n", "path_n"]].sum()
    assert n.loc["eager:fp8e4m3", "n"] == docs * reported
    assert n.loc["eager:fp8e4m3", "path_n"] == docs * 6
    assert n.loc["shared:nvfp4+sr", "n"] == 2 * docs * reported
    # the printed table's positions column: the computed rows of each cell
    table = text[text.index("KL(P_fp32 || P_policy)"):text.index("stepwise check")]
    rows = {ln.split()[0]: ln.split() for ln in table.splitlines()[2:] if ln.strip()}
    assert int(rows["eager:fp8e4m3"][-1]) == docs * reported
    assert int(rows["shared:nvfp4+sr"][-1]) == 2 * docs * reported
