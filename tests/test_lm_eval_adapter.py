"""lm-eval adapter (issue 6): offline, CPU, small models.

A tiny random Gated DeltaNet hybrid (qwen3_5) with a small byte-level BPE tokenizer trained
here on a few KJV books is saved to a temporary directory, so these tests exercise the same
``from_pretrained`` path as real checkpoints; the CLI test uses the shipped ``tiny-gdn``.
"""

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from replayssm_quant.adapters.segments import forward_segment  # noqa: E402
from replayssm_quant.evals.lm_eval_adapter import POLICY_GRAMMAR, ReplaySSMLM, sequence_id  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

LL_REQUESTS = [
    ("In the beginning God created the heaven and the earth. And the earth was without form,",
     " and void; and darkness was upon the face of the deep."),
    ("And God said, Let there be light:", " and there was light."),
    ("And God saw the light, that it was good: and God divided the light from the darkness.",
     " And God called the light Day, and the darkness he called Night."),
]
GEN_PROMPTS = ["In the beginning", "And God said unto Moses,"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from replayssm_quant.adapters.tiny import tiny_config
    from replayssm_quant.data import load_corpus

    text = [d["text"] for d in load_corpus("kjv", "train")[:2]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")
    cfg = tiny_config("qwen3_5")
    cfg.vocab_size = len(fast)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path_factory.mktemp("tiny_gdn_lm")
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return str(out)


def _ll(lm, reqs=LL_REQUESTS):
    return [r[0] for r in lm.loglikelihood(
        [Instance("loglikelihood", {}, req, i) for i, req in enumerate(reqs)], disable_tqdm=True)]


def _gen(lm, n=8):
    args = {"until": ["\n\n"], "max_gen_toks": n, "do_sample": False}
    return lm.generate_until(
        [Instance("generate_until", {}, (p, dict(args)), i) for i, p in enumerate(GEN_PROMPTS)],
        disable_tqdm=True)


def _lm(path, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 2)
    return ReplaySSMLM(pretrained=path, **kw)


def test_fp32_equals_plain_hflm(tiny_dir):
    plain = HFLM(pretrained=tiny_dir, device="cpu", batch_size=2, dtype="float32")
    ours = _lm(tiny_dir, state="fp32", dtype="float32")
    a, b = _ll(plain), _ll(ours)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4, (a, b)
    assert _gen(plain) == _gen(ours)


def test_policy_differs_and_is_reproducible(tiny_dir):
    fp32 = _ll(_lm(tiny_dir, state="fp32"))
    q1 = _ll(_lm(tiny_dir, state="shared:nvfp4+sr", window=4, seed=3))
    q2 = _ll(_lm(tiny_dir, state="shared:nvfp4+sr", window=4, seed=3))
    assert q1 == q2  # bitwise reproducible for a fixed seed
    assert max(abs(x - y) for x, y in zip(fp32, q1)) > 1e-3
    # batch composition does not change a request's score
    single = _ll(_lm(tiny_dir, state="shared:nvfp4+sr", window=4, seed=3, batch_size=1))
    assert single == q1


def test_loglikelihood_equals_stepwise_decoding(tiny_dir):
    """Teacher-forced continuation scoring equals stepping token by token (float64 model)."""
    lm = _lm(tiny_dir, state="read:nvfp4/rec:fp16+sr", window=3, seed=1, dtype="float64",
             batch_size=1)
    ctx, cont = LL_REQUESTS[2]
    got = _ll(lm, [(ctx, cont)])[0]
    ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
    assert len(cont_ids) > 2 * 3  # several windows of the continuation
    inp = (ctx_ids + cont_ids)[:-1]
    lm.handle.sequence_ids = [sequence_id(inp)]
    model = lm.model
    with torch.no_grad():
        logits, cache = forward_segment(model, torch.tensor([ctx_ids]))  # exact prefill
        total = torch.log_softmax(logits[0, -1].double(), -1)[cont_ids[0]].item()
        for i, (prev, nxt) in enumerate(zip(cont_ids[:-1], cont_ids[1:])):
            logits, cache = forward_segment(model, torch.tensor([[prev]]), cache,
                                            start=len(ctx_ids) + i)
            total += torch.log_softmax(logits[0, -1].double(), -1)[nxt].item()
    lm.handle.sequence_ids = None
    assert abs(got - total) <= 1e-6 * max(1.0, abs(total)), (got, total)


def test_rolling_loglikelihood_runs_under_policy(tiny_dir):
    lm = _lm(tiny_dir, state="shared:fp8e4m3", window=4)
    text = LL_REQUESTS[0][0] + LL_REQUESTS[0][1]
    res = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)],
                                   disable_tqdm=True)
    assert len(res) == 1 and res[0] < 0 and torch.isfinite(torch.tensor(res[0]))


@pytest.mark.parametrize("bad", ["nvfp4", "shared:nvfp5", "read:nvfp4", "shared:fp8+rtn", ""])
def test_bad_state_fails_at_construction(tiny_dir, bad):
    with pytest.raises(ValueError) as e:
        _lm(tiny_dir, state=bad)
    assert repr(bad) in str(e.value) and POLICY_GRAMMAR in str(e.value)


@pytest.mark.parametrize("arg,val", [("window", 0), ("window", "x"), ("seed", -1), ("max_drafts", "1.5")])
def test_bad_numeric_args(tiny_dir, arg, val):
    with pytest.raises(ValueError, match=arg):
        _lm(tiny_dir, **{arg: val})


@pytest.mark.parametrize("args", [dict(max_drafts=17), dict(max_drafts=5, window=4),
                                  dict(max_drafts=2, state="eager:fp8e4m3"),
                                  dict(max_drafts=2, state="map:fp32@L1=eager:fp8e4m3")])
def test_drafts_beyond_the_window_refused(args):
    """max_drafts as the decode state objects take it: 0 <= T <= L (L = 1 under eager),
    refused before anything loads; T = L is fine."""
    from replayssm_quant.evals.lm_eval_adapter import check_model_args

    with pytest.raises(ValueError, match=f"max_drafts={args['max_drafts']} must be <= window"):
        check_model_args(args)
    check_model_args(dict(args, max_drafts=args.get("window", 1 if "state" in args else 16)))


def _cli(tmp_path, limit, tasks, context_chars, *extra):
    out = tmp_path / "lm_eval_out"
    cmd = [sys.executable, "-m", "replayssm_quant.evals.lm_eval_adapter", "--model", "replayssm",
           "--model_args", "pretrained=tiny-gdn,state=read:nvfp4/rec:fp32",
           "--tasks", tasks, "--include_path", str(REPO / "evals" / "tasks"),
           "--limit", str(limit), "--device", "cpu", "--output_path", str(out),
           "--metadata", json.dumps({"context_chars": context_chars}), *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    assert res["config"]["replayssm_state"] == "read:nvfp4/rec:fp32"
    assert "state" in str(res["config"]["model_args"])
    return res


def test_cli_runs_offline_on_embedded_model(tmp_path):
    """Also issue 12 item 3: ``--batch_size auto`` (HFLM's probe) runs from the command line."""
    pytest.importorskip("replayssm_quant.models")
    res = _cli(tmp_path, 2, "kjv_longctx_mc", 600, "--batch_size", "auto", "--max_batch_size", "4")
    assert str(res["config"]["batch_size"]).startswith("auto")
    assert 0.0 <= res["results"]["kjv_longctx_mc"]["acc,none"] <= 1.0


@pytest.mark.slow  # 56 s; loglikelihood_rolling without the CLI: test_rolling_loglikelihood_runs_under_policy
def test_cli_rolling_perplexity_task(tmp_path):
    """kjv_longctx_ppl: every passage token under the policy (loglikelihood_rolling)."""
    import math

    res = _cli(tmp_path, 2, "kjv_longctx_ppl", 600)
    r = res["results"]["kjv_longctx_ppl"]
    assert math.isfinite(r["word_perplexity,none"]) and r["word_perplexity,none"] > 1.0
    assert 0.0 < r["bits_per_byte,none"] < 8.0


@pytest.mark.slow
def test_cli_issue_command_limit8_both_forms(tmp_path):
    res = _cli(tmp_path, 8, "kjv_longctx_mc,kjv_longctx_gen", 12000)
    assert set(res["results"]) >= {"kjv_longctx_mc", "kjv_longctx_gen"}


@pytest.mark.parametrize("margs,word", [("pretrained=tiny-gdn,state=bogus", "state"),
                                        ("pretrained=tiny-gdn,window=0", "window"),
                                        ('{"pretrained": "tiny-gdn", "seed": -2}', "seed"),
                                        ("pretrained=no-such-model", "pretrained='no-such-model'"),
                                        ("pretrained=tiny-gdn,window=-3", "got -3\n"),
                                        ("pretrained=tiny-mamba2,dt_limit=clip", "dt_limit"),
                                        # a float is shown as typed, not as the int it equals
                                        ("pretrained=tiny-gdn,window=16.0", "got 16.0\n"),
                                        ("pretrained=tiny-gdn,seed=9223372036854775808",
                                         "seed must be an integer in [0, 9223372036854775807]"),
                                        # lm-eval's command line passes these itself
                                        ("pretrained=tiny-gdn,batch_size=4",
                                         "give --batch_size 4 instead"),
                                        ("pretrained=tiny-gdn,device=cpu", "give --device cpu"),
                                        ("pretrained=tiny-gdn,softmax_dtype=float33",
                                         "softmax_dtype must be one of float16, bfloat16"),
                                        ("pretrained=tiny-gdn,dtype=float33",
                                         "dtype must be one of auto, float16"),
                                        ("pretrained=tiny-gdn,max_length=-5",
                                         "max_length must be an integer >= 1, got -5\n"),
                                        ("pretrained=tiny-gdn,max_length=0", "max_length")])
def test_cli_bad_model_args_exit_2(margs, word, capsys):
    from replayssm_quant.evals.lm_eval_adapter import cli

    rc = cli(["--model", "replayssm", "--model_args", margs, "--tasks", "kjv_longctx_mc"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("replayssm-lm-eval: error:") and word in err


def test_policy_map_the_model_refuses_exits_2(monkeypatch, capsys):
    """A policy map that only the loaded model can refuse (layer 99 of a 4-layer model) raises
    ModelArgumentError (a ValueError naming the layer) from the constructor, and the command
    line reports it in one line with exit code 2 (lm-eval's task loading is skipped here)."""
    from lm_eval._cli.harness import HarnessCLI

    from replayssm_quant.evals.lm_eval_adapter import ModelArgumentError, cli

    with pytest.raises(ModelArgumentError, match="layer 99"):
        _embedded_lm("tiny-gdn", state="map:fp32@L99=shared:fp16")

    def execute(self, args):  # what lm-eval's run does first with our model arguments
        _embedded_lm("tiny-gdn", state="map:fp32@L99=shared:fp16")

    monkeypatch.setattr(HarnessCLI, "execute", execute)
    rc = cli(["--model", "replayssm", "--model_args", "pretrained=tiny-gdn,state=map:fp32@L99=shared:fp16",
              "--tasks", "kjv_longctx_mc"])
    err = capsys.readouterr().err  # (after transformers' weight-loading progress bar)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("replayssm-lm-eval: error:") and "layer 99" in last


# ------------------------------------------------ issue 12: numbers a user can trust
def _embedded_lm(name, **kw):
    kw.setdefault("device", "cpu")
    return ReplaySSMLM(pretrained=name, **kw)


def _tricky_requests(lm):
    """Requests whose rows collide under right padding or content lookup: A; a row that is
    A's row plus the pad token 0 (and one that adds two 0s); A's tokens split elsewhere
    (same row, other prefill); two continuations of one context with equal token counts (one
    group of the batch); and a longer unrelated request."""
    ctx, cont = lm._encode_pair("In the beginning God created the heaven", " and the earth")
    row = (ctx + cont)[:-1]
    c2, d1 = lm._encode_pair("And God said, Let there be light:", " and there was light.")
    _, d2 = lm._encode_pair("And God said, Let there be light:", " and there was night.")
    assert len(d1) == len(d2)
    reqs = [(ctx, cont), (row + [0], [cont[-1]]), (ctx, cont[:-1] + [0, 0, cont[-1]]),
            (ctx[:-2], ctx[-2:] + cont), (c2, d1), (c2, d2),
            lm._encode_pair(LL_REQUESTS[0][0], LL_REQUESTS[0][1])]
    return [(None, list(c), list(k)) for c, k in reqs]


def _scores(lm, reqs, bs):
    return [r[0] for r in lm._loglikelihood_tokens(reqs, disable_tqdm=True, override_bs=bs)]


# the default suite: every kind of policy once (fp32 and shared RTN NVFP4 for both families);
# the other three cases (6-7 s each on 2 cores, 2026-12-06) with -m slow
BATCH_CASES = [
    pytest.param("tiny-mamba2", "fp32", id="mamba2-fp32"),
    pytest.param("tiny-mamba2", "shared:nvfp4", id="mamba2-shared_nvfp4"),
    pytest.param("tiny-mamba2", "shared:nvfp4+sr", id="mamba2-shared_nvfp4_sr"),
    pytest.param("tiny-mamba2", "read:nvfp4/rec:fp16+sr", id="mamba2-read_nvfp4_rec_fp16_sr", marks=pytest.mark.slow),
    pytest.param("tiny-mamba2", "eager:fp8e4m3", id="mamba2-eager_fp8e4m3"),
    pytest.param("tiny-gdn", "fp32", id="gdn-fp32"),
    pytest.param("tiny-gdn", "shared:nvfp4", id="gdn-shared_nvfp4"),
    pytest.param("tiny-gdn", "shared:nvfp4+sr", id="gdn-shared_nvfp4_sr", marks=pytest.mark.slow),
    pytest.param("tiny-gdn", "read:nvfp4/rec:fp16+sr", id="gdn-read_nvfp4_rec_fp16_sr"),
    pytest.param("tiny-gdn", "eager:fp8e4m3", id="gdn-eager_fp8e4m3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model,state", BATCH_CASES)
def test_scores_bit_identical_for_every_batch_size_and_position(model, state):
    """Issue 12 item 2: a request scored alone (its own call, batch of 1) is the oracle; every
    batch size, ``batch_size=auto`` and a reversed request list give bit-identical scores,
    including rows that collide under padding and rows of equal length and prefill."""
    lm = _embedded_lm(model, state=state, window=4, seed=5, batch_size="auto", max_batch_size=4)
    reqs = _tricky_requests(lm)
    alone = [_scores(lm, [r], 1)[0] for r in reqs]
    for bs in (2, 3, len(reqs), None):  # None: HFLM's batch_size=auto probe and schedule
        assert _scores(lm, reqs, bs) == alone, (bs, _scores(lm, reqs, bs), alone)
    assert _scores(lm, reqs[::-1], 2)[::-1] == alone


def test_rows_out_of_the_queued_order_stop_the_run(monkeypatch):
    """If lm-eval batched rows in another order than the adapter queued them, scoring stops
    with an error (no request is scored with another row's prefill)."""
    import replayssm_quant.evals.lm_eval_adapter as adapter

    lm = _embedded_lm("tiny-mamba2", state="shared:nvfp4", window=4, batch_size=2)
    reqs = _tricky_requests(lm)
    monkeypatch.setattr(adapter, "_hflm_row_order", lambda r: len(r[1] + r[2]))  # shortest first
    with pytest.raises(RuntimeError, match="another order"):
        _scores(lm, reqs, None)


def test_batch_size_auto_matches_batch_size_1():
    """Issue 12 item 3: ``batch_size=auto`` (HFLM's probe, then its schedule) scores through
    ``loglikelihood`` and ``loglikelihood_rolling`` exactly as ``batch_size=1``."""
    kw = dict(state="shared:nvfp4+sr", window=4, seed=2, max_length=64)  # probe width
    auto = _embedded_lm("tiny-mamba2", batch_size="auto", max_batch_size=4, **kw)
    one = _embedded_lm("tiny-mamba2", batch_size=1, **kw)
    assert _ll(auto) == _ll(one)
    text = [Instance("loglikelihood_rolling", {}, (a + b,), i)
            for i, (a, b) in enumerate(LL_REQUESTS)]
    assert (auto.loglikelihood_rolling(text, disable_tqdm=True)
            == one.loglikelihood_rolling(text, disable_tqdm=True))


def test_logprobs_are_fp32_log_softmax_of_the_logits():
    """Issue 12 item 4: with a bfloat16 model the score is the FP32 log_softmax of the logits
    ``_model_call`` returned (oracle: float64 log_softmax of the same logits); an explicit
    ``softmax_dtype`` still goes through HFLM's mechanism."""
    def scored(lm):
        seen = []
        call = lm._model_call
        lm._model_call = lambda *a, **k: seen.append(call(*a, **k)) or seen[-1]
        ctx, cont = lm._encode_pair(*LL_REQUESTS[0])
        score = _scores(lm, [(None, ctx, cont)], 1)[0]
        (logits,) = seen
        assert logits.dtype == torch.bfloat16
        n = len(ctx) + len(cont) - 1
        pos = torch.arange(n - len(cont), n)
        picked = logits[0, pos].double().log_softmax(-1)[torch.arange(len(cont)), cont]
        bf16 = logits[0, pos].log_softmax(-1)[torch.arange(len(cont)), cont]  # HFLM sums in it
        return score, picked.sum().item(), bf16.sum().item()

    lm = _embedded_lm("tiny-gdn", state="shared:nvfp4", window=4, dtype="bfloat16")
    score, oracle, bf16 = scored(lm)
    assert abs(bf16 - oracle) > 1e-3  # the example tells the two apart
    assert abs(score - oracle) <= 1e-5 * abs(oracle), (score, oracle, bf16)
    lm = _embedded_lm("tiny-gdn", state="shared:nvfp4", window=4, dtype="bfloat16",
                      softmax_dtype="bfloat16")
    score, oracle, bf16 = scored(lm)
    assert score == bf16, (score, oracle, bf16)


def _task_doc_ids(model_args: dict, metadata: dict) -> list[str]:
    """Doc ids of kjv_longctx_mc as lm-eval's command line builds the task (its config merges
    the model arguments into the task metadata)."""
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks import TaskManager

    tasks = str(REPO / "evals" / "tasks")
    cfg = EvaluatorConfig(model="replayssm", model_args=dict(model_args), tasks="kjv_longctx_mc",
                          include_path=tasks, metadata=dict(metadata))._configure()
    assert cfg.metadata.items() >= cfg.model_args.items()  # lm-eval's merge, as on its CLI
    manager = TaskManager(include_path=tasks, include_defaults=False, metadata=cfg.metadata)
    task = manager.load("kjv_longctx_mc")["tasks"]["kjv_longctx_mc"]
    return [d["id"] for d in task.test_docs()]


def test_task_items_do_not_depend_on_model_args():
    """Issue 12 item 13: the README's model arguments (``window=16,seed=0``), another SR seed
    or none at all leave the shipped task's items unchanged; its own ``item_seed`` changes them."""
    meta = {"context_chars": 600, "n_items": 6}
    base = {"pretrained": "tiny-gdn", "state": "read:nvfp4/rec:fp32"}
    plain = _task_doc_ids(base, meta)
    assert len(plain) == 6
    assert _task_doc_ids(base | {"window": 16, "seed": 0}, meta) == plain
    assert _task_doc_ids(base | {"seed": 1}, meta) == plain
    assert _task_doc_ids(base, meta | {"item_seed": 7}) != plain


def _kjv_utils():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kjv_longctx_utils", REPO / "evals" / "tasks" / "kjv_longctx" / "utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_task_words_match_str_split():
    """The shipped task counts and takes words without splitting the rest of a book: its
    ``_first_words`` equals ``text[s:].split()[:n]`` from every position of a text with
    assorted Unicode whitespace, and every item's target and choices are the first
    ``n_words`` words after a sentence start, by ``str.split`` on the embedded corpus."""
    from replayssm_quant.data import load_corpus

    u = _kjv_utils()
    text = "a  b\tc\n\nd\xa0e\u2003f\x1cg\u3000 hh, i. J k\r\nl m  "
    for s in range(len(text) + 1):
        for n in (1, 3, 100):
            assert u._first_words(text, s, n) == text[s:].split()[:n], (s, n)
    books = {d["title"]: d["text"] for d in load_corpus("kjv", "heldout")}
    items = u._items(context_chars=600, n_items=12, n_words=5)
    assert len(items) == 12
    for it in items:
        title, _, p = it["id"].rpartition("@")
        book = books[title]
        assert it["target"] == " ".join(book[int(p):].split()[:5])
        assert it["context"] in book[int(p) - 600:int(p)]
        for c in it["choices"]:
            assert len(c.split()) == 5 and c in book


def _no_load(init):
    """A stand-in for HFLM.__init__ with its signature that fails if anything loads."""
    import functools

    @functools.wraps(init)
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    return no_load


def test_unknown_model_arg_refused_before_loading(monkeypatch):
    """Issue 12 item 14: an unknown key is refused before the model loads, naming it and the
    accepted keys (ours and every named parameter of HFLM.__init__)."""
    import inspect

    monkeypatch.setattr(HFLM, "__init__", _no_load(HFLM.__init__))
    with pytest.raises(ValueError) as e:
        ReplaySSMLM(pretrained="tiny-gdn", frobnicate=3)
    msg = str(e.value)
    assert "frobnicate=3" in msg and "\n" not in msg
    hflm = [p.name for p in inspect.signature(HFLM.__init__).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    listed = set(msg.split("accepts: ", 1)[1].split(", "))
    assert set(hflm) | {"state", "window", "seed", "max_drafts", "gdn_fold"} <= listed


@pytest.mark.parametrize("margs,word", [
    (["pretrained=tiny-gdn,frobnicate=3"], "frobnicate=3"),
    (["pretrained=tiny-gdn", "frobnicate=3"], "frobnicate=3"),  # lm-eval's space-separated form
    (['{"pretrained": "tiny-gdn", "frobnicate": 3}'], "frobnicate=3"),
    (["pretrained=tiny-gdn,logits_cache=True"], "logits_cache"),
])
def test_cli_unknown_model_arg_exit_2_before_loading(margs, word, capsys, monkeypatch):
    from replayssm_quant.evals.lm_eval_adapter import cli

    monkeypatch.setattr(HFLM, "__init__", _no_load(HFLM.__init__))
    rc = cli(["--model", "replayssm", "--model_args", *margs, "--tasks", "kjv_longctx_mc",
              "--include_path", str(REPO / "evals" / "tasks"), "--limit", "1",
              "--metadata", '{"context_chars": 600, "n_items": 1}'])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("replayssm-lm-eval: error:") and word in err and "\n" not in err
    if word.startswith("frobnicate"):
        assert "accepts: " in err and "softmax_dtype" in err and "window" in err


def test_cli_accepts_hflm_model_args():
    """Every accepted key passes the pre-load check (e.g. HFLM's max_length, softmax_dtype)."""
    from replayssm_quant.evals.lm_eval_adapter import accepted_model_args, check_model_args

    check_model_args("pretrained=tiny-gdn,max_length=64,softmax_dtype=float32,dtype=bfloat16")
    check_model_args({k: None for k in accepted_model_args() if k not in
                      ("state", "window", "seed", "max_drafts", "gdn_fold", "dt_limit")})


def test_dt_limit_model_arg_reaches_the_adapters():
    """``dt_limit=clamp`` is the adapters' rule for every state the model creates, and is
    recorded in the results' model info (issue 12 item 9)."""
    lm = _embedded_lm("tiny-mamba2", dt_limit="clamp")
    assert str(lm.handle.dt_limit) == "clamp"
    assert lm.get_model_info()["replayssm_dt_limit"] == "clamp"
    assert str(_embedded_lm("tiny-mamba2").handle.dt_limit) == "decode"


def test_model_info_records_the_softmax_dtype():
    """The results record the log-softmax dtype, whose default differs from HFLM's (None)."""
    assert _embedded_lm("tiny-gdn").get_model_info()["replayssm_softmax_dtype"] == "torch.float32"
    lm = _embedded_lm("tiny-gdn", softmax_dtype="float64")
    assert lm.get_model_info()["replayssm_softmax_dtype"] == "torch.float64"


@pytest.mark.parametrize("extra, word", [
    (["--batch_size", "0"], "--batch_size '0'"),
    (["--batch_size", "-2"], "--batch_size '-2'"),
    (["--batch_size", "auto:0"], "--batch_size 'auto:0'"),
    (["--batch_size", "many"], "--batch_size 'many'"),
    (["--output_path", "{afile}/out"], "is not a directory"),
    # an existing file where lm-eval would write a folder (the path does not end in .json)
    (["--output_path", "{afile}"], "exists and is not a directory (lm-eval writes a folder"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--device", "foo"], "--device 'foo': expected cpu, cuda, cuda:N or mps"),
    (["--device", "meta"], "--device 'meta': expected cpu, cuda, cuda:N or mps"),
    (["--device", "cpu:1"], "--device 'cpu:1': expected"),
    (["--metadata", "context_chars=-5"], "--metadata context_chars=-5: the kjv_* tasks"),
    (["--metadata", "n_items=0"], "n_items=0"),
])
def test_cli_run_args_refused_before_loading(extra, word, tmp_path, capsys, monkeypatch):
    """lm-eval values that would fail late or pass silently exit 2 in one line before any
    model loads: a batch size below 1 (HFLM takes 0 and runs), an output path under a file
    (lm-eval logs that after the run and exits 0), CUDA where torch has none."""
    from replayssm_quant.evals.lm_eval_adapter import cli

    if extra[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    afile = tmp_path / "afile"
    afile.write_text("x")
    extra = [e.format(afile=afile) for e in extra]
    monkeypatch.setattr(HFLM, "__init__", _no_load(HFLM.__init__))
    rc = cli(["--model", "replayssm", "--model_args", "pretrained=tiny-gdn", "--tasks",
              "kjv_longctx_mc", "--include_path", str(REPO / "evals" / "tasks"), "--limit", "1",
              *extra])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("replayssm-lm-eval: error:") and word in err and "\n" not in err


@pytest.mark.parametrize("value, word", [
    ("bogus", "REPLAYSSM_BACKEND='bogus' is not a backend: use one of 'auto', 'torch'"),
    ("cuda", "REPLAYSSM_BACKEND='cuda' needs a CUDA device, got cpu"),
    # HFLM's backend model argument is its model class (lm-eval asserts), not the kernels'
    ("margs", "model argument backend='cuda': this is HFLM's model class, one of default, "
              "causal, seq2seq; the kernels are chosen with the environment variable "
              "REPLAYSSM_BACKEND"),
])
def test_cli_backend_env_refused_before_loading(value, word, capsys, monkeypatch):
    """A ``REPLAYSSM_BACKEND`` that names no backend, or one that cannot run on ``--device``,
    and a ``backend=`` model argument HFLM would assert on, exit 2 in one line before any
    model loads (they were tracebacks)."""
    from replayssm_quant.evals.lm_eval_adapter import cli

    margs = "pretrained=tiny-gdn" + (",backend=cuda" if value == "margs" else "")
    if value != "margs":
        monkeypatch.setenv("REPLAYSSM_BACKEND", value)
    monkeypatch.setattr(HFLM, "__init__", _no_load(HFLM.__init__))
    rc = cli(["--model", "replayssm", "--model_args", margs, "--tasks",
              "kjv_longctx_mc", "--include_path", str(REPO / "evals" / "tasks"), "--limit", "1",
              "--device", "cpu"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("replayssm-lm-eval: error:") and word in err and "\n" not in err


def test_check_run_args_accepts_lm_eval_forms(tmp_path):
    """``auto``, ``auto:N`` and positive integers pass, as does an output path that is an
    existing directory or a new file under one."""
    from types import SimpleNamespace

    from replayssm_quant.evals.lm_eval_adapter import check_run_args

    for bs in ("1", "8", "auto", "auto:4", 16, None):
        check_run_args(SimpleNamespace(batch_size=bs, output_path=None, device="cpu"))
    for out in (tmp_path, tmp_path / "new" / "results.json", tmp_path / "new_dir" / "sub"):
        check_run_args(SimpleNamespace(batch_size=None, output_path=str(out), device=None))
    assert not (tmp_path / "new_dir").exists()  # checked, nothing made


def test_hflm_args_refused_before_loading(tmp_path, monkeypatch):
    """The Python API checks HFLM's own arguments before the model loads: a batch size below
    1 (HFLM takes it and runs), an unknown dtype name (torch's AttributeError otherwise), a
    max_length below 1, and a model directory without config.json."""
    monkeypatch.setattr(HFLM, "__init__", _no_load(HFLM.__init__))
    for kw, word in ((dict(batch_size=0), "batch_size 0: expected a positive integer"),
                     (dict(batch_size=-3), "batch_size -3"),
                     (dict(batch_size="auto:0"), "'auto:0'"),
                     (dict(softmax_dtype="float33"), "softmax_dtype must be one of"),
                     (dict(dtype="half-ish"), "dtype must be one of auto"),
                     (dict(max_length=0), "max_length must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=re.escape(word)):
            ReplaySSMLM(pretrained="tiny-gdn", **kw)
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        ReplaySSMLM(pretrained=str(empty))
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file; expected a model directory"):
        ReplaySSMLM(pretrained=str(afile))


def test_cli_task_that_builds_no_items_exit_2(capsys):
    """A kjv_* option no held-out passage fits (context_chars beyond every book) is one line,
    exit 2, naming the options, not lm-eval's IndexError on an empty task."""
    from replayssm_quant.evals.lm_eval_adapter import cli

    rc = cli(["--model", "replayssm", "--model_args", "pretrained=tiny-gdn", "--tasks",
              "kjv_longctx_mc", "--include_path", str(REPO / "evals" / "tasks"), "--limit", "1",
              "--device", "cpu", "--metadata", "context_chars=1000000000"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("replayssm-lm-eval: error: kjv_longctx: no held-out passage fits "
                          "context_chars=1000000000")


def test_lm_eval_forms_that_pass_the_checks(tmp_path):
    """What lm-eval itself takes passes the early checks: dtype names HFLM resolves through
    getattr(torch, ...) (``auto``, ``half``, ``double``), JSON model args, max_batch_size in
    --model_args when --max_batch_size is not given, devices torch parses, an output path
    ending in .json (written beside it, also where a folder of that name exists)."""
    from types import SimpleNamespace

    from replayssm_quant.evals.lm_eval_adapter import check_model_args, check_run_args

    for margs in ("pretrained=tiny-gdn,dtype=auto,softmax_dtype=float32",
                  "pretrained=tiny-gdn,dtype=half,softmax_dtype=double",
                  '{"pretrained": "tiny-gdn", "dtype": "bfloat16", "max_length": 64}',
                  "pretrained=tiny-gdn,max_batch_size=8"):
        check_model_args(margs, cli=True)
    with pytest.raises(ValueError, match="give --max_batch_size 8 instead"):
        check_model_args("pretrained=tiny-gdn,max_batch_size=8", cli=True, cli_max_batch_size=4)
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        check_model_args("dtype=torch.float16")  # getattr(torch, "torch.float16") fails in HFLM
    (tmp_path / "runs.json").mkdir()
    mps = torch.backends.mps.is_available()
    if not mps:
        with pytest.raises(ValueError, match="--device mps: MPS is not available"):
            check_run_args(SimpleNamespace(batch_size=None, output_path=None, device="mps"))
    for device in ("cpu", "cuda:0" if torch.cuda.is_available() else "cpu",
                   "mps" if mps else "cpu"):
        for out in (tmp_path / "results.json", tmp_path / "runs.json", tmp_path / "d" / "r.json"):
            check_run_args(SimpleNamespace(batch_size="auto:4", output_path=str(out),
                                           device=device))


def test_cli_window_beyond_memory_exit_2(capsys):
    """A window whose L x L matrices cannot fit even one sequence is refused in one line,
    exit 2, when the policy is applied to the loaded model (before any request is scored)."""
    from replayssm_quant.evals.lm_eval_adapter import cli

    from replayssm_quant.capabilities import device_memory_bytes

    if device_memory_bytes(torch.device("cpu")) is None:
        pytest.skip("this machine's memory size cannot be read")
    rc = cli(["--model", "replayssm", "--model_args",
              "pretrained=tiny-gdn,state=shared:nvfp4,window=4194304", "--tasks",
              "kjv_longctx_mc", "--include_path", str(REPO / "evals" / "tasks"), "--limit", "1",
              "--device", "cpu", "--metadata", '{"context_chars": 600, "n_items": 1}'])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after lm-eval's own log lines
    assert err.startswith("replayssm-lm-eval: error: model arguments do not fit")
    assert "window L=4194304: the window form's L x L" in err


def test_cli_interrupt_is_one_line_exit_130(capsys, monkeypatch):
    from lm_eval._cli.harness import HarnessCLI

    from replayssm_quant.evals.lm_eval_adapter import cli

    def stop(self, args):
        raise KeyboardInterrupt

    monkeypatch.setattr(HarnessCLI, "execute", stop)
    rc = cli(["--model", "replayssm", "--model_args", "pretrained=tiny-gdn", "--tasks",
              "kjv_longctx_mc", "--include_path", str(REPO / "evals" / "tasks")])
    assert rc == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("replayssm-lm-eval: interrupted") and "\n" not in err


def test_cli_kjv_tasks_without_include_path_hint(capsys, monkeypatch):
    """The package's kjv_* tasks are not lm-eval's: without --include_path lm-eval's "Tasks
    not found" becomes one line that names the flag and the tasks' directory (exit 2)."""
    from replayssm_quant.evals import TASKS_DIR
    from replayssm_quant.evals.lm_eval_adapter import cli

    monkeypatch.setattr(HFLM, "__init__", _no_load(HFLM.__init__))
    rc = cli(["--model", "replayssm", "--model_args", "pretrained=tiny-gdn", "--tasks",
              "kjv_longctx_mc", "--limit", "1"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("replayssm-lm-eval: error: Tasks not found")
    assert f"--include_path {TASKS_DIR}" in err


def test_console_entry_interrupt_before_cli_guard(capsys, monkeypatch):
    """The console script's entry imports the adapter inside its own Ctrl-C guard: an
    interrupt there (or in the argument parsing) is one line, exit 130."""
    import replayssm_quant.evals.lm_eval_adapter as adapter
    from replayssm_quant.evals.lm_eval_main import main

    def stop(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(adapter, "cli", stop)
    assert main([]) == 130
    assert capsys.readouterr().err.strip() == "replayssm-lm-eval: interrupted"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_names_the_tool_and_the_replayssm_model(argv, capsys):
    """``replayssm-lm-eval --help`` and ``run --help`` are lm-eval's help under the tool's
    name, with the ``replayssm`` model's own arguments (each with its default), an example
    and the tasks' --include_path."""
    from replayssm_quant.evals import TASKS_DIR
    from replayssm_quant.evals.lm_eval_adapter import cli

    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: replayssm-lm-eval")
    assert "replayssm model arguments (--model replayssm" in out
    for arg in ("pretrained=", "state=", "window=", "seed=", "max_drafts=", "gdn_fold=",
                "dt_limit=", "decay_stats="):
        assert arg in out
    assert f"--include_path {TASKS_DIR}" in out
    assert "--tasks" in out  # lm-eval's own options are still there
