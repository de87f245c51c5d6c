"""Shared test configuration.

Tests are CPU-only: Triton kernels run under the interpreter (TRITON_INTERPRET=1), which must
be set before triton is imported anywhere.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny matmuls are far faster single-threaded on the shared 2-core CI machine.
torch.set_num_threads(1)


import json  # noqa: E402

import pytest  # noqa: E402

#: Text of the small runner fixtures (``data_file``): three overlapping documents.
KL_TEXT = ("In the beginning God created the heaven and the earth. And the earth was without "
           "form, and void; and darkness was upon the face of the deep. ") * 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random qwen3_5 (GDN + attention) saved as a model directory (no tokenizer)."""
    from replayssm_quant.adapters.tiny import tiny_model

    d = tmp_path_factory.mktemp("tinygdn")
    tiny_model("qwen3_5").save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A JSONL file of three documents cut from :data:`KL_TEXT`."""
    d = tmp_path_factory.mktemp("data")
    f = d / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"d{i}", "text": KL_TEXT[i * 7:]}) for i in range(3)))
    return str(f)
