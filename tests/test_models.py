"""Embedded reference models: shipped files, offline loading by short name, name resolution."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayssm_quant.models import EMBEDDED_MODELS, is_embedded, load_model, resolve_model_path

REPO = Path(__file__).resolve().parents[1]
MAX_BYTES = 25 * 1000 * 1000
PROMPT = "And the LORD spake unto Moses, saying,"
# First words of Joshua (a held-out book).
HELDOUT_TEXT = ("Now after the death of Moses the servant of the LORD it came to pass, that the LORD spake unto "
                "Joshua the son of Nun, Moses' minister, saying, Moses my servant is dead; now therefore arise, go "
                "over this Jordan, thou, and all this people, unto the land which I do give to them, even to the "
                "children of Israel.")


def _safetensors_dtypes(path: Path) -> set[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module", params=sorted(EMBEDDED_MODELS))
def loaded(request):
    os.environ["HF_HUB_OFFLINE"] = "1"
    model, tok = load_model(request.param)
    return request.param, model, tok


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_shipped_files(name):
    path = Path(resolve_model_path(name))
    assert path == EMBEDDED_MODELS[name] and path.is_dir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / f).is_file(), f
    st = path / "model.safetensors"
    assert st.stat().st_size <= MAX_BYTES
    assert _safetensors_dtypes(st) == {"F32"}
    cfg = json.loads((path / "config.json").read_text())
    if name == "tiny-gdn":
        assert cfg["model_type"] == "qwen3_5_text"
        assert {"linear_attention", "full_attention"} <= set(cfg["layer_types"])
    else:
        assert cfg["model_type"] == "nemotron_h"
        assert {"linear_attention", "mlp", "full_attention"} <= set(cfg["layers_block_type"])


def test_loaded_offline(loaded):
    name, model, tok = loaded
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    n = sum(p.numel() for p in model.parameters())
    assert 1e6 < n < 6.25e6
    assert len(tok) == model.config.vocab_size == 4096
    expected = {"tiny-gdn": "Qwen3_5ForCausalLM", "tiny-mamba2": "NemotronHForCausalLM"}[name]
    assert type(model).__name__ == expected


def test_heldout_text_is_predicted(loaded):
    """Regression guard on quality: NLL on a held-out sentence far below a uniform guess
    (ln 4096 = 8.3) and below the unigram model's ~6 nats/token."""
    _, model, tok = loaded
    ids = tok(HELDOUT_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert nll < 4.0, nll


def test_greedy_generation(loaded):
    _, model, tok = loaded
    x = tok(PROMPT, return_tensors="pt")
    out = model.generate(**x, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, x.input_ids.shape[1]:], skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 3
    assert sum(w.strip(",.;:").isalpha() for w in words) >= len(words) - 1, text


def test_resolve_aliases_and_local_dirs(tmp_path):
    assert is_embedded("tiny-gdn") and is_embedded("TINY_MAMBA2")
    assert resolve_model_path("Tiny_GDN") == str(EMBEDDED_MODELS["tiny-gdn"])
    local = EMBEDDED_MODELS["tiny-mamba2"]
    assert resolve_model_path(local) == str(local)
    assert resolve_model_path("nvidia/NVIDIA-Nemotron-Nano-9B-v2") == "nvidia/NVIDIA-Nemotron-Nano-9B-v2"


def test_resolve_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model_path(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(ValueError, match="unknown model name 'tiny-foo'"):
        resolve_model_path("tiny-foo")
    with pytest.raises(ValueError, match="unknown model name 'qwen'") as e:
        resolve_model_path("qwen")
    assert "did you mean" not in str(e.value)  # nothing close
    # a near miss names the embedded model it is close to, for both kinds of error
    first = next(iter(EMBEDDED_MODELS))
    with pytest.raises(ValueError, match=rf"unknown model name .*did you mean {first!r}\?$"):
        resolve_model_path(first[:-1] + "x")
    with pytest.raises(FileNotFoundError, match=rf"does not exist: .*did you mean {first!r}\?$"):
        resolve_model_path(first.replace("-", "_") + "!")
    with pytest.raises(ValueError, match="empty"):
        resolve_model_path("  ")
    for bad in (None, 3):
        with pytest.raises(TypeError, match="model name or path must be a str or os.PathLike"):
            load_model(bad)
    # a bad model dtype is named with the model dtypes listed (a state format such as fp16,
    # an integer or fp8 torch dtype included), before anything loads
    for bad in ("float33", "fp16", torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=rf"dtype {re.escape(repr(bad))} is not a model "
                                             r"dtype; expected one of float32, bfloat16, float16"):
            load_model("tiny-gdn", dtype=bad)


def test_missing_embedded_files(monkeypatch, tmp_path):
    import replayssm_quant.models as models

    monkeypatch.setitem(models.EMBEDDED_MODELS, "tiny-gdn", tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="reinstall"):
        resolve_model_path("tiny-gdn")


@pytest.mark.slow
def test_fresh_process_offline_by_short_name():
    """A fresh interpreter with HF_HUB_OFFLINE=1 loads both models through the Auto classes."""
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "from replayssm_quant.models import resolve_model_path\n"
        "for n in ('tiny-gdn', 'tiny-mamba2'):\n"
        "    p = resolve_model_path(n)\n"
        "    m = AutoModelForCausalLM.from_pretrained(p); t = AutoTokenizer.from_pretrained(p)\n"
        "    print(n, type(m).__name__, m(**t('In the beginning', return_tensors='pt')).logits.shape)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Qwen3_5ForCausalLM" in r.stdout and "NemotronHForCausalLM" in r.stdout
