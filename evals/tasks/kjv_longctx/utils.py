"""Long-context continuation tasks built at run time from the embedded corpus (held-out KJV books).

Each item takes a point where a sentence starts in a held-out book, gives the model the
preceding ``context_chars`` characters (default 12,000: about 3,000 tokens of the tiny models'
tokenizer), and asks for the next words of the passage: as multiple choice (true
continuation versus three sentence openings from elsewhere in the same book) and as free
generation scored by leading-word agreement; ``kjv_longctx_ppl`` scores the passage itself
(rolling log-likelihood: every token under the policy). Long contexts are where recurrent-state
rounding has had time to accumulate, so these tasks show its downstream cost.

Options (``--metadata '{"context_chars": 4000, "n_items": 32}'``): context_chars, n_items,
n_words, item_seed. Nothing is downloaded: the text comes from the installed corpus package.

lm-eval hands a task's ``custom_dataset`` its metadata merged with the model arguments, so
the options must not share a name with any model argument: the sampling seed is
``item_seed``, never ``seed`` (the model's stochastic-rounding seed), and the items scored
depend only on these options (version 2.0; version 1.0 read ``seed`` and so sampled other
items when the model had a ``seed`` argument).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import re

_SENTENCE_END = re.compile(r"(?<=[.;:?!])\s+")
_WORD = re.compile(r"[^\w']+")
_TOKEN = re.compile(r"\S+")  # the words of str.split() (the same whitespace, str.isspace)


def _first_words(text: str, start: int, n: int) -> list[str]:
    """``text[start:].split()[:n]`` without splitting the rest of the book."""
    return [m.group() for m in itertools.islice(_TOKEN.finditer(text, start), n)]


def _items(context_chars=12000, n_items=64, n_words=8, item_seed=1234, n_choices=4):
    from replayssm_quant.data import load_corpus

    context_chars, n_items, n_words = int(context_chars), int(n_items), int(n_words)
    if context_chars < 1 or n_items < 1 or n_words < 1:
        raise ValueError(f"kjv_longctx: context_chars, n_items and n_words must be >= 1, got "
                         f"{context_chars}, {n_items}, {n_words}")
    rng = random.Random(int(item_seed))
    docs = load_corpus("kjv", "heldout")
    per_book = math.ceil(n_items / len(docs))
    items = []
    for d in docs:
        text = d["text"]
        starts = [m.end() for m in _SENTENCE_END.finditer(text)]  # each at a word's start
        words = [m.start() for m in _TOKEN.finditer(text)]
        # len(text[s:].split()) >= n_words: at least n_words words start at or after s
        cands = [s for s in starts
                 if s >= context_chars and len(words) - bisect.bisect_left(words, s) >= n_words]
        if len(cands) < n_choices:
            continue
        for p in sorted(rng.sample(cands, min(per_book, len(cands)))):
            ctx = text[p - context_chars:p].rstrip()
            ctx = ctx[ctx.find(" ") + 1:] if " " in ctx else ctx
            target = " ".join(_first_words(text, p, n_words))
            pool = [s for s in cands if abs(s - p) > 2000]
            distract = []
            for s in rng.sample(pool, len(pool)):
                cand = " ".join(_first_words(text, s, n_words))
                if cand != target and cand not in distract:
                    distract.append(cand)
                if len(distract) == n_choices - 1:
                    break
            choices = distract + [target]
            rng.shuffle(choices)
            items.append({"id": f"{d['title']}@{p}", "book": d["title"], "context": ctx,
                          "target": target, "choices": choices, "label": choices.index(target)})
    if not items:  # lm-eval would fail on task_docs[0] with an IndexError
        raise ValueError(f"kjv_longctx: no held-out passage fits context_chars={context_chars} "
                         f"and n_words={n_words} (each book needs at least {n_choices} sentence "
                         f"starts with that much text before them and n_words words after); "
                         f"lower them")
    return items[:n_items]


def _dataset(**kw):
    import datasets

    allowed = {"context_chars", "n_items", "n_words", "item_seed"}  # no model-argument names
    items = _items(**{k: v for k, v in kw.items() if k in allowed})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def load_mc(**kwargs):
    """Dataset for ``kjv_longctx_mc`` (lm-eval ``custom_dataset``)."""
    return _dataset(**kwargs)


def load_gen(**kwargs):
    """Dataset for ``kjv_longctx_gen`` (lm-eval ``custom_dataset``)."""
    return _dataset(**kwargs)


def load_ppl(**kwargs):
    """Dataset for ``kjv_longctx_ppl`` (lm-eval ``custom_dataset``): the same passages of
    ``context_chars`` characters, scored as a whole by ``loglikelihood_rolling``. Unlike the
    multiple-choice and generation tasks, whose context runs through the exact prefill, every
    token of the passage then runs under the state policy, so the state error of a passage of
    that length reaches the score (word / byte perplexity)."""
    return _dataset(**kwargs)


def _words(s: str) -> list[str]:
    return [w for w in _WORD.split(s.lower()) if w]


def process_gen(doc, results):
    """Leading-word agreement of a generation with the true continuation.

    Returns ``prefix_words``: fraction of the target's words matched in order from the start
    (stops at the first mismatch), and ``first_word``: 1 if the first word matches.
    """
    pred, gold = _words(results[0]), _words(doc["target"])
    n = 0
    for a, b in zip(pred, gold):
        if a != b:
            break
        n += 1
    return {"prefix_words": n / len(gold), "first_word": float(bool(gold) and n > 0)}
