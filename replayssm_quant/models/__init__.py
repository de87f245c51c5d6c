"""Embedded reference models, loadable offline by short name.

Two small causal LMs of real Hugging Face hybrid architectures, trained by this project
on the KJV training split (``scripts/train_reference_models.py``) and shipped inside the
package as ordinary Hugging Face model directories (config.json, model.safetensors,
tokenizer files; FP32 weights):

- ``tiny-gdn``: ``replayssm_quant/models/tiny_gdn``, ``qwen3_5_text`` (``Qwen3_5ForCausalLM``:
  Gated DeltaNet layers and one full-attention layer);
- ``tiny-mamba2``: ``replayssm_quant/models/tiny_mamba2``, ``nemotron_h``
  (``NemotronHForCausalLM``: Mamba-2, MLP and one attention layer).

They are small demonstration models (model cards in ``docs/models/``), not substitutes
for the models studied in the ReplaySSM paper.

Every runner accepts either a short name, a local model directory, or a hub id;
:func:`resolve_model_path` does the mapping and :func:`load_model` loads through
``AutoModelForCausalLM`` / ``AutoTokenizer`` exactly as for any checkpoint. Embedded
models are always loaded with ``local_files_only=True``, so nothing touches the network.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["EMBEDDED_MODELS", "MODELS_DIR", "embedded_model_names", "is_embedded", "load_model", "resolve_model_path"]

#: Directory holding the shipped model directories.
MODELS_DIR = Path(__file__).resolve().parent

#: Short name -> shipped model directory.
EMBEDDED_MODELS: dict[str, Path] = {
    "tiny-gdn": MODELS_DIR / "tiny_gdn",
    "tiny-mamba2": MODELS_DIR / "tiny_mamba2",
}

# "org/name" (or a bare "name") with the characters the hub allows; anything else that does
# not exist locally is treated as a missing path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def embedded_model_names() -> tuple[str, ...]:
    return tuple(EMBEDDED_MODELS)


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def is_embedded(name_or_path: str | os.PathLike) -> bool:
    """True if ``name_or_path`` is one of the short names in :data:`EMBEDDED_MODELS`."""
    return isinstance(name_or_path, str) and _normalise(name_or_path) in EMBEDDED_MODELS


def _did_you_mean(name: str) -> str:
    """``"; did you mean 'tiny-gdn'?"`` when ``name`` is close to an embedded model's name
    (difflib's ratio >= 0.6, compared in lower case), else ``""``."""
    close = difflib.get_close_matches(name.strip().lower(), list(EMBEDDED_MODELS), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Map a short name to its shipped directory; pass local directories and hub ids through.

    Returns a string suitable for ``from_pretrained``.

    Raises:
        FileNotFoundError: a short name whose shipped directory is missing (broken install),
            or something that looks like a local path but does not exist, is a file, or is
            a directory without config.json.
        ValueError: an empty name, or a bare name that is neither embedded, a local
            directory, nor a hub id of the form ``org/name``.
        TypeError: ``name_or_path`` is not a str or os.PathLike (e.g. None).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"model name or path must be a str or os.PathLike, got "
                        f"{type(name_or_path).__name__} {name_or_path!r}")
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError("model name or path is empty")
    if is_embedded(name):
        path = EMBEDDED_MODELS[_normalise(name)]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"embedded model {name!r} is missing its files under {str(path)!r}; "
                "reinstall replayssm-quant (package data) or rebuild with scripts/train_reference_models.py"
            )
        return str(path)
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise FileNotFoundError(f"model path {str(p)!r} is a file; expected a model directory "
                                    f"(config.json and weights), an embedded model "
                                    f"({', '.join(EMBEDDED_MODELS)}) or a hub id 'org/name'")
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(p)!r} has no config.json")
        return str(p)
    if not _HUB_ID.match(name):
        raise FileNotFoundError(
            f"model path does not exist: {name!r} (embedded models: {', '.join(EMBEDDED_MODELS)})"
            + _did_you_mean(name)
        )
    if "/" not in name:
        raise ValueError(
            f"unknown model name {name!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}), "
            "not an existing directory, and not a hub id of the form 'org/name'"
            + _did_you_mean(name)
        )
    return name  # a hub id; from_pretrained decides (and fails clearly when offline)


def load_model(
    name_or_path: str | os.PathLike,
    dtype: Any = None,
    device: Any = "cpu",
    *,
    tokenizer: bool = True,
    **kwargs: Any,
):
    """Load ``(model, tokenizer)`` through ``AutoModelForCausalLM`` / ``AutoTokenizer``.

    Args:
        name_or_path: ``"tiny-gdn"``, ``"tiny-mamba2"``, a local model directory or a hub id.
        dtype: torch dtype (or its name, e.g. ``"float32"``); default FP32, the dtype the
            embedded weights are stored in.
        device: where to put the model (default CPU).
        tokenizer: also load the tokenizer (otherwise the second element is ``None``).
        **kwargs: passed to ``from_pretrained`` (e.g. ``attn_implementation="eager"``). With
            ``device_map`` (e.g. ``"auto"`` or a module -> device dict) accelerate places the
            weights and ``device`` is not applied.

    The model is returned in ``eval()`` mode.

    Raises:
        ValueError: a ``dtype`` that is not one of the model dtypes (float32, bfloat16, float16
            or float64, as a torch dtype or its name), naming it and listing those.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16, "float64": torch.float64}
    if dtype is None:
        dtype = torch.float32
    elif not (dtype in model_dtypes or dtype in model_dtypes.values()):
        raise ValueError(f"dtype {dtype!r} is not a model dtype; expected one of "
                         f"{', '.join(model_dtypes)} (a torch dtype or its name; the state's "
                         f"formats, such as fp16 or nvfp4, are set by the state policy)")
    dtype = model_dtypes.get(dtype, dtype)
    path = resolve_model_path(name_or_path)
    if is_embedded(os.fspath(name_or_path)):
        kwargs.setdefault("local_files_only", True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if kwargs.get("device_map") is None:
        model = model.to(device)
    model = model.eval()  # a device-mapped model stays where accelerate placed it
    tok = None
    if tokenizer:
        tok_kwargs = {k: v for k, v in kwargs.items()
                      if k in ("local_files_only", "revision", "trust_remote_code", "token")}
        tok = AutoTokenizer.from_pretrained(path, **tok_kwargs)
    return model, tok
