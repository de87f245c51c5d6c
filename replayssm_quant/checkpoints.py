"""What a flush produces and how its casts are keyed (DESIGN.md section 3, "Flush").

A leaf module (``docs/architecture.md``): plain data types and small helpers shared by the
torch references (:mod:`replayssm_quant.replay`) and the Triton kernels
(:mod:`replayssm_quant.kernels.replay`), importing only other leaves.

* :class:`Checkpoints`: the dequantised recurrence anchor A and read copy R, and their storage;
* :class:`FlushResult`: the unrounded state of a flush, its checkpoints and the folded values;
* :func:`checkpoint_streams`: the SR stream keys of the two casts of one flush;
* :func:`length_mask`: which record slots of a batch are live.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packed import PackedTensor
from .philox import STREAM_FIELDS, STREAM_SHIFTS, stream_key, stream_keys_to

__all__ = ["ANCHOR_COPY", "READ_COPY", "PREFILL_FLUSH_INDEX", "Checkpoints", "FlushResult",
           "checkpoint_streams", "length_mask"]

ANCHOR_COPY = 0  # stream_key copy bit of the recurrence anchor A (and of a shared checkpoint)
READ_COPY = 1  # stream_key copy bit of the read copy R
PREFILL_FLUSH_INDEX = 0  # the cast of a prefill (or of the initial zero state) is flush 0
#: ``checkpoint_streams`` builds CUDA keys on the device from this many matrices (B x heads)
DEVICE_KEYS_MIN_MATRICES = 1024


def length_mask(length: torch.Tensor, J: int) -> torch.Tensor:
    """``[B, J]`` bool: record slot ``j`` is live (``j < length[b]``)."""
    return torch.arange(J, device=length.device)[None, :] < length[:, None]


def checkpoint_streams(*, layer: int, sequence_ids: torch.Tensor, heads: int,
                       flush_index: torch.Tensor, on_device: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream keys ``[B, H]`` of the anchor and read casts of one flush, keyed by
    (layer, sequence id, head, flush index, copy) only: never by call order or batch position.

    ``sequence_ids`` int ``[B]``; ``flush_index`` int ``[B]`` (or a scalar). Keys are int64 on
    ``sequence_ids``' device, packed as :func:`~replayssm_quant.philox.stream_key` packs them
    (``philox.STREAM_FIELDS``). ``on_device`` builds them where the ids live with the same
    integer operations, so a flush on the GPU does not wait for the host; the range of the
    per-sequence fields is then checked by a device-side assertion (``torch._assert_async``),
    ``layer`` and ``heads`` on the host. Default: on the device for CUDA ids and at least
    :data:`DEVICE_KEYS_MIN_MATRICES` matrices (B x heads). On the H200 the host build cost
    0.4-0.5 ms per flush at B = 256 (``flush_tune_h200.json``); the device build's ~25 small
    launches cost 0.2-0.4 ms more than the host build at B = 1 (``decode_h200.json`` runs,
    docs/kernels-replay.md), so small batches keep the host build. The keys are the same
    either way. Raises ValueError (host build) for a field out of range."""
    dev = sequence_ids.device
    if on_device is None:
        on_device = dev.type == "cuda" and sequence_ids.numel() * heads >= DEVICE_KEYS_MIN_MATRICES
    if not on_device:
        seq = sequence_ids.to(torch.int64)[:, None]
        fl = torch.as_tensor(flush_index, dtype=torch.int64).reshape(-1)[:, None]
        head = torch.arange(heads, dtype=torch.int64)[None, :]
        sa = stream_key(layer=layer, sequence=seq.cpu(), head=head, flush=fl.cpu(),
                        copy=ANCHOR_COPY)
        sr = sa | READ_COPY  # the copy bit is the key's lowest field (philox.STREAM_FIELDS)
        return stream_keys_to(sa, dev), stream_keys_to(sr, dev)
    stream_key(layer=layer, head=heads - 1)  # host range check of the host fields
    seq = sequence_ids.to(torch.int64)[:, None]
    fl = torch.as_tensor(flush_index, dtype=torch.int64, device=dev).reshape(-1)[:, None]
    width = dict(STREAM_FIELDS)
    torch._assert_async(((seq >= 0) & (seq < (1 << width["sequence"]))).all()
                        & ((fl >= 0) & (fl < (1 << width["flush"]))).all())
    head = torch.arange(heads, dtype=torch.int64, device=dev)[None, :]
    fields = dict(layer=layer, sequence=seq, head=head, flush=fl, copy=ANCHOR_COPY)
    sa = torch.zeros((), dtype=torch.int64, device=dev)
    for name, shift in STREAM_SHIFTS.items():
        sa = sa | (torch.as_tensor(fields[name], dtype=torch.int64, device=dev) << shift)
    return sa, sa | READ_COPY


@dataclass
class Checkpoints:
    """Result of :func:`replayssm_quant.replay.core.cast_checkpoints`: dequantised A and R
    (working dtype) and, when requested, their real storage. For single-checkpoint policies
    ``read is anchor``."""

    anchor: torch.Tensor
    read: torch.Tensor
    anchor_stored: "PackedTensor | torch.Tensor | None" = None
    read_stored: "PackedTensor | torch.Tensor | None" = None


@dataclass
class FlushResult:
    """What a flush produces: the unrounded reconstructed ``state`` (the flush token's output is
    read from it), the new checkpoints and the values ``w`` that were folded (GDN: the
    corrections used). The kernels' flushes leave ``w`` None where the caller asks them not
    to return it (``return_w=False``; the state objects' kernel flushes, which read only the
    state and the checkpoints), and ``state`` None without ``store_state``."""

    state: torch.Tensor | None
    checkpoints: Checkpoints
    w: torch.Tensor | None
