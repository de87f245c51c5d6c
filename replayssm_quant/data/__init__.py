"""Corpora for long-document runs: embedded KJV (default), local files, PG-19.

See :mod:`replayssm_quant.data.corpus` for the document schema and the fixed KJV split.
"""

from .corpus import (
    KJV_HELDOUT_EVERY,
    KJV_HELDOUT_OFFSET,
    KJV_SPLITS,
    PG19_HUB_ID,
    PG19_SPLITS,
    Document,
    corpus_names,
    kjv_books,
    kjv_heldout_titles,
    kjv_path,
    load_corpus,
    load_local,
    load_pg19,
    long_documents,
)

from .corpus import __all__  # noqa: E402,F401  (one list of public names, in corpus.py)
