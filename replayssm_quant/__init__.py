"""replayssm-quant: numerical accuracy of low-precision recurrent state under ReplaySSM.

Public API (DESIGN.md is the contract):

* formats and quantizers: :func:`quantize`, :func:`pack`, :class:`PackedTensor`,
  :func:`parse_spec`, :class:`QuantSpec`, :func:`stream_key`;
* the ReplaySSM layer: :class:`StatePolicy`, :class:`Mamba2ReplayState`,
  :class:`GDNReplayState` (recurrence anchor + read copy + buffer of the last L inputs);
* settings parsed once: :class:`StateConfig` (policy, effective window, seed, GDN fold);
* real models under a policy: :func:`state_policy` (context manager) and
  :func:`apply_state_policy`, from :mod:`.adapters`; :func:`load_model` (embedded names, local
  directories, hub ids), :func:`load_corpus` and :func:`long_documents` (imported on first use:
  they need the ``eval`` extra, transformers / datasets);
* subpackages: ``adapters`` (transformers models under a state policy), ``models`` (embedded
  trained models), ``data`` (corpora), ``reference`` (stepwise recurrences), ``kernels``
  (reached through :mod:`.backend`), ``evals`` (KL runner, lm-eval adapter) and ``analysis``
  (error-propagation theory, result loading, plots), the last two kept at the repository root
  and mapped into this package by ``pyproject.toml``. The module layers are in
  ``docs/architecture.md``.
"""

import importlib.abc
import importlib.util
import os
import sys

from .config import StateConfig
from .formats import FORMAT_NAMES, QuantSpec, parse_spec
from .packed import PackedTensor
from .philox import stream_key
from .policy import StatePolicy
from .quant import pack, quantize
from .replay import GDNReplayState, Mamba2ReplayState

__version__ = "0.1.0"

__all__ = [
    "FORMAT_NAMES",
    "QuantSpec",
    "parse_spec",
    "stream_key",
    "PackedTensor",
    "pack",
    "quantize",
    "StatePolicy",
    "Mamba2ReplayState",
    "GDNReplayState",
    "state_policy",
    "apply_state_policy",
    "StateConfig",
    "load_model",
    "load_corpus",
    "long_documents",
]


_LAZY = {  # imported on first use: the adapters and models need transformers, data needs datasets
    "state_policy": "adapters", "apply_state_policy": "adapters",
    "load_model": "models", "load_corpus": "data", "long_documents": "data",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# ------------------------------------------------------------------ source checkout
# ``evals/`` and ``analysis/`` live at the repository root and install as
# ``replayssm_quant.evals`` / ``replayssm_quant.analysis`` (pyproject.toml ``package-dir``).
# Run from a source checkout (repository root on PYTHONPATH, or an editable install of another
# checkout), this finder maps the two names to the folders next to this package, ahead of any
# other finder, so the runners always come from the same tree as the library. Installed from a
# wheel (no pyproject.toml beside the package) nothing is added.
_ROOT_SUBPACKAGES = ("evals", "analysis")


class _SourceCheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``replayssm_quant.evals`` / ``.analysis`` in a source checkout's root folders."""

    def __init__(self, dirs: dict):
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        d = self.dirs.get(fullname)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(d, "__init__.py"), submodule_search_locations=[d])


def _map_source_checkout() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return
    dirs = {f"{__name__}.{n}": os.path.join(root, n) for n in _ROOT_SUBPACKAGES
            if os.path.isfile(os.path.join(root, n, "__init__.py"))}
    if dirs and not any(type(f).__name__ == _SourceCheckoutFinder.__name__
                        and getattr(f, "dirs", None) == dirs for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceCheckoutFinder(dirs))


_map_source_checkout()
