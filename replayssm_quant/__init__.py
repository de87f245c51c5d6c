"""replayssm-quant: numerical accuracy of low-precision recurrent state under ReplaySSM.

Public API (DESIGN.md is the contract):

* formats and quantizers: :func:`quantize`, :func:`pack`, :class:`PackedTensor`,
  :func:`parse_spec`, :class:`QuantSpec`, :func:`stream_key`.
"""

from .formats import FORMAT_NAMES, QuantSpec, parse_spec
from .philox import stream_key
from .quant import PackedTensor, pack, quantize

__version__ = "0.1.0"

__all__ = [
    "FORMAT_NAMES",
    "QuantSpec",
    "parse_spec",
    "stream_key",
    "PackedTensor",
    "pack",
    "quantize",
]

# ReplaySSM layer (issue 3): state policies and the dual-checkpoint state objects.
from .policy import StatePolicy  # noqa: E402
from .replay import GDNReplayState, Mamba2ReplayState  # noqa: E402

__all__ += ["StatePolicy", "Mamba2ReplayState", "GDNReplayState"]
