"""Corpus documents -> token documents of exactly N + 1 ids, with the BOS choice of lm-eval's HFLM.

BOS (``--add-bos-token``), mirroring ``lm_eval.models.huggingface.HFLM``'s ``add_bos_token``:

* ``auto`` (default, HFLM's ``None``): the tokenizer's own default, i.e. ``tokenizer(text)``
  with ``add_special_tokens=True`` -- a document starts with BOS exactly when the tokenizer adds
  one by default (Llama-style tokenizers do; GPT-2 / Qwen-style ones, and the embedded models'
  tokenizers, do not);
* ``true``: the tokenizer is loaded with ``add_bos_token=True`` (as HFLM passes it to
  ``from_pretrained``) and documents are encoded with ``add_special_tokens=True``; if the
  tokenizer still puts no BOS first, the runner prepends ``bos_token_id`` (recorded as
  ``bos_source: runner``); a tokenizer without a BOS token is an error (exit 2);
* ``false``: ``add_special_tokens=False`` (HFLM's ``add_bos_token=False``): no special tokens.

Documents shorter than N + 1 tokens are joined with the following ones: each member is encoded
on its own with the choice above (so every member starts with BOS when BOS is on), and members
are separated by the encoding of a blank line (never with special tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["BOS_CHOICES", "Tokenization", "BadTokenizer", "load_tokenization", "make_documents"]

BOS_CHOICES = ("auto", "true", "false")
PROBE_TEXT = "In the beginning"


class BadTokenizer(ValueError):
    """The tokenizer cannot honour the requested BOS choice (a user error, exit 2)."""


@dataclass
class Tokenization:
    """How documents are turned into ids.

    Attributes:
        encode_raw: ``(text, add_special_tokens) -> ids``.
        name: tokenizer class name, or ``utf8-bytes-mod-<V>`` for the byte fallback.
        add_bos_token: the ``--add-bos-token`` choice (``auto``, ``true``, ``false``).
        add_special_tokens: what documents are encoded with.
        bos_token_id: the tokenizer's BOS id (None if it has none).
        prepend_bos: the runner prepends BOS itself (``true`` on a tokenizer that does not add it).
        fallback: why the UTF-8 byte fallback is used (None with a tokenizer).
    """

    encode_raw: Callable[[str, bool], list]
    name: str
    add_bos_token: str = "auto"
    add_special_tokens: bool = True
    bos_token_id: int | None = None
    prepend_bos: bool = False
    starts_with_bos: list = field(default_factory=list)
    bos_text: str | None = None
    fallback: str | None = None

    def encode_document(self, text: str) -> list:
        # like HFLM.tok_encode: a text that already starts with the BOS string gets no second BOS
        special = self.add_special_tokens and not (self.bos_text and text.startswith(self.bos_text))
        ids = list(self.encode_raw(text, special))
        if self.prepend_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_plain(self, text: str) -> list:
        return list(self.encode_raw(text, False))

    def manifest(self) -> dict:
        return {"tokenizer": self.name, "add_bos_token": self.add_bos_token,
                "add_special_tokens": self.add_special_tokens, "bos_token_id": self.bos_token_id,
                "bos_source": ("runner" if self.prepend_bos else "tokenizer"),
                "documents_starting_with_bos": int(sum(self.starts_with_bos)),
                "documents": len(self.starts_with_bos)}


#: Files whose presence in a model directory means it ships a tokenizer (transformers' names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "vocab.txt")


def load_tokenization(path: str, vocab: int, add_bos_token: str = "auto") -> Tokenization:
    """The model directory's tokenizer (or the UTF-8 byte fallback, ``ids = bytes mod vocab``,
    when the directory has no tokenizer files; ``Tokenization.fallback`` then says why, for the
    caller to report) with the BOS choice applied (HFLM's ``add_bos_token``). Raises
    :class:`BadTokenizer` for ``true`` without a BOS token, for tokenizer files that do not load
    or encode :data:`PROBE_TEXT` to nothing (naming the files and the error), and for a
    tokenizer whose ids reach past the model's vocabulary ``vocab``."""
    if add_bos_token not in BOS_CHOICES:
        raise BadTokenizer(f"--add-bos-token must be one of {', '.join(BOS_CHOICES)}, "
                           f"got {add_bos_token!r}")
    files = ([f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
             if os.path.isdir(path) else [])
    tok, why = None, f"model {path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
    try:
        from transformers import AutoTokenizer

        kw = {"add_bos_token": True} if add_bos_token == "true" else {}
        tok = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path), **kw)
        probe = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    except Exception as e:  # noqa: BLE001 - model directories without a tokenizer
        if files:
            raise BadTokenizer(f"model {path!r}: its tokenizer files ({', '.join(files)}) do not "
                               f"load: {type(e).__name__}: {e}") from None
        tok = None
        if not os.path.isdir(path):
            why = f"no tokenizer loads for {path!r} ({type(e).__name__}: {e})"
    if tok is not None and not probe:  # a directory without tokenizer files loads an empty one
        if files:
            raise BadTokenizer(f"model {path!r}: its tokenizer ({', '.join(files)}) encodes "
                               f"{PROBE_TEXT!r} to no ids")
        tok = None
    if tok is not None and max(probe) >= vocab:
        raise BadTokenizer(f"model {path!r}: its tokenizer encodes {PROBE_TEXT!r} to id "
                           f"{max(probe)}, outside the model's vocabulary of {vocab}")
    if tok is None:
        if add_bos_token == "true":
            raise BadTokenizer(f"--add-bos-token true: model {path!r} has no usable tokenizer "
                               "(the runner falls back to UTF-8 bytes), so there is no BOS token; "
                               "use --add-bos-token auto or false")
        return Tokenization(lambda s, special: [b % vocab for b in s.encode("utf-8")],
                            f"utf8-bytes-mod-{vocab}", add_bos_token, False, None, False,
                            fallback=f"{why}: documents are encoded as UTF-8 bytes mod {vocab}")
    bos = tok.bos_token_id
    if add_bos_token == "true":
        if bos is None:
            raise BadTokenizer(f"--add-bos-token true: tokenizer {type(tok).__name__} of {path!r} "
                               "has no BOS token; use --add-bos-token auto or false")
        if bos >= vocab:
            raise BadTokenizer(f"--add-bos-token true: BOS id {bos} is outside the model's "
                               f"vocabulary of {vocab}")
    special = add_bos_token != "false"
    t = Tokenization(lambda s, sp: tok(s, add_special_tokens=sp)["input_ids"], type(tok).__name__,
                     add_bos_token, special, bos, False, bos_text=tok.bos_token)
    if add_bos_token == "true":
        first = t.encode_raw(PROBE_TEXT, True)
        t.prepend_bos = not first or first[0] != bos
    return t


def make_documents(docs, tokz: Tokenization, n_tokens: int, max_docs: int) -> list:
    """Token documents of exactly ``n_tokens`` ids: each corpus document alone if long enough,
    else joined with the following ones (blank-line separator), in corpus order. Each gets
    ``id``, ``ids`` and ``sha`` (hash of its ids, the resume key)."""
    out, ids, members = [], [], []
    sep = tokz.encode_plain("\n\n")
    for d in docs:
        if ids:
            ids = ids + sep
        ids = ids + tokz.encode_document(d["text"])
        members.append(str(d.get("id", d.get("title", len(out)))))
        if len(ids) >= n_tokens:
            out.append({"id": "+".join(members), "ids": ids[:n_tokens]})
            ids, members = [], []
            if len(out) == max_docs:
                break
    for d in out:
        d["sha"] = hashlib.sha256(json.dumps(list(d["ids"])).encode()).hexdigest()[:24]
    tokz.starts_with_bos = [bool(tokz.bos_token_id is not None and d["ids"][0] == tokz.bos_token_id
                                 and tokz.add_special_tokens) for d in out]
    return out
