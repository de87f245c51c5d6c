"""replayssm-quant: numerical accuracy of low-precision recurrent state under ReplaySSM.

Public API (DESIGN.md is the contract):

* formats and quantizers: :func:`quantize`, :func:`pack`, :class:`PackedTensor`,
  :func:`parse_spec`, :class:`QuantSpec`, :func:`stream_key`;
* the ReplaySSM layer: :class:`StatePolicy`, :class:`Mamba2ReplayState`,
  :class:`GDNReplayState` (recurrence anchor + read copy + buffer of the last L inputs);
* subpackages: ``adapters`` (transformers models under a state policy), ``models`` (embedded
  trained models), ``data`` (corpora), ``reference`` (stepwise recurrences), ``kernels``.
"""

from .formats import FORMAT_NAMES, QuantSpec, parse_spec
from .philox import stream_key
from .policy import StatePolicy
from .quant import PackedTensor, pack, quantize
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
]
