"""Counter-based random bits for stochastic rounding (DESIGN.md section 3, last paragraph).

Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
written in plain torch so that it reproduces, bit for bit, ``tl.philox(seed, c0, c1, c2, c3)``
of Triton (``triton/language/random.py``), which the kernels call. The mapping is:

* key  (k0, k1) = (seed & 0xffffffff, seed >> 32) with ``seed`` a 64-bit user seed;
* the element index ``e`` inside the matrix is row-major over the last two dims (the padded
  row length of blocked formats is NOT used: ``e = m * K + k``);
* counter c0 = ``e >> 2``: one Philox call serves four consecutive elements, and element ``e``
  takes output word ``e & 3`` (since 2026-12-02; before, c0 = e and word 0, so every element
  cost one call, and Philox's multiplies and XORs were about a third of the instructions of
  the nvfp4 flush on the H200: docs/kernels-replay.md, "Eighth pass");
* counter (c1, c2) = low and high 32 bits of the 64-bit ``stream`` key of the matrix;
* counter c3 = 0 (reserved).

Every draw is a pure function of (seed, stream, element) (DESIGN.md section 3), so stepwise
decoding, chunked emulation and any batch composition draw identical bits. Word ``w`` of
call ``c`` is never used for any other element, so the draws stay independent.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["philox4x32", "random_bits", "random_bits_matrix", "stream_key", "stream_keys_to",
           "check_seed", "SEED_LIMIT", "STREAM_FIELDS", "WORDS_PER_CALL"]

_M32 = 0xFFFFFFFF
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10  # Triton's N_ROUNDS_DEFAULT
WORDS_PER_CALL = 4  # consecutive elements served by one Philox call (output words 0..3)


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product of constant ``a`` and uint32 values ``b``
    held in int64, computed with 16-bit halves so that nothing overflows int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t = a_hi * b  # < 2^48
    u = a_lo * b  # < 2^48
    hi = (t + (u >> 16)) >> 16  # floor(a b / 2^32) < 2^32: no mask needed
    lo = (((t & 0xFFFF) << 16) + u) & _M32
    return hi, lo


def philox4x32(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 on int64 tensors holding uint32 values (broadcasting).

    Returns the four output words as int64 tensors in [0, 2^32). Matches Triton's
    ``philox_impl`` round for round.
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _M32 for c in (c0, c1, c2, c3))
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    k0 &= _M32
    k1 &= _M32
    # The words are not broadcast up front: with per-matrix stream words (c1, c2, c3) and a
    # per-element counter c0, the first two rounds then work on the small operands only.
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return tuple(torch.broadcast_to(c, shape) for c in (c0, c1, c2, c3))


def as_int(value) -> int | None:
    """``value`` as a Python int if it is an integer (``int``, numpy integers: any
    ``numbers.Integral``) and not a bool; else None. The one rule for the integer arguments
    (seeds, windows, counts) checked across the package, so a numpy integer is accepted
    wherever an int is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


SEED_LIMIT = 2**63
"""Seeds of the rounding streams are ints in [0, SEED_LIMIT): they travel as int64 (torch,
the kernels' arguments), so the top bit is not theirs."""


def check_seed(seed, who: str = "") -> int:
    """``seed`` as a Python int in [0, 2^63) (:data:`SEED_LIMIT`; a numpy integer is taken
    as its int). The one rule for the seeds of the quantizers, the state configs and the
    kernels. ``who`` prefixes the message. Raises ValueError naming the value otherwise."""
    s = as_int(seed)
    if s is None or not 0 <= s < SEED_LIMIT:
        raise ValueError(f"{who + ': ' if who else ''}seed must be an int in [0, 2^63), "
                         f"got {seed!r}")
    return s


def _check_key(seed) -> int:
    """The Philox key's own range, [0, 2^64) (two 32-bit words); the generators below take
    any such key, the package's callers pass seeds already checked by :func:`check_seed`."""
    s = as_int(seed)
    if s is None or not 0 <= s < 2**64:
        raise ValueError(f"seed must be an int in [0, 2^64), got {seed!r}")
    return s


def _int64_values(value, name: str) -> torch.Tensor:
    """``value`` (an int, a sequence of ints, or an integer tensor) as an int64 tensor (a
    tensor keeps its device). Raises ValueError naming ``name`` for anything else: floats
    (which ``torch.as_tensor(..., dtype=torch.int64)`` would truncate, so 1.7 would become the
    key 1), bools, strings, and ints outside int64."""
    what = "an int or integer tensor (int64 range)"
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be {what}, got a tensor of dtype {value.dtype}")
        return value.to(torch.int64)
    if isinstance(value, (bool, float, complex, str, bytes)) or value is None:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"{name} must be {what}, got {value!r} ({e})") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be {what}, got {value!r} (dtype {t.dtype})")
    return t.to(torch.int64)


def _check_stream(stream, name: str = "stream") -> torch.Tensor:
    """Stream keys (:func:`stream_key`) as int64: an int, a sequence of ints or an integer
    tensor. Raises ValueError naming ``name`` otherwise (floats, bools, strings, ints beyond
    int64)."""
    return _int64_values(stream, name)


def _calls(seed: int, stream: torch.Tensor, calls: torch.Tensor):
    """The four output words of the Philox calls ``calls`` of ``stream`` (broadcasting)."""
    return philox4x32(
        calls, stream & _M32, (stream >> 32) & _M32,
        torch.zeros((), dtype=torch.int64, device=stream.device),
        seed & _M32, (seed >> 32) & _M32,
    )


def random_bits(seed: int, stream: torch.Tensor, element: torch.Tensor) -> torch.Tensor:
    """32 random bits per element, as int64 in [0, 2^32): word ``element & 3`` of the Philox
    call with counter ``(element >> 2, stream lo, stream hi, 0)`` (module docstring).

    Args:
        seed: user seed, 0 <= seed < 2^64 (Philox key).
        stream: int64 tensor of 64-bit stream keys, broadcastable against ``element``.
        element: int64 tensor of element indices (< 2^32) inside the matrix.

    Raises:
        ValueError: ``seed`` not an int in [0, 2^64), or float stream keys.
    """
    seed = _check_key(seed)
    stream = _check_stream(stream)
    element = torch.as_tensor(element, dtype=torch.int64, device=stream.device)
    w0, w1, w2, w3 = _calls(seed, stream, element >> 2)
    word = element & 3
    return torch.where(word < 2, torch.where(word == 0, w0, w1),
                       torch.where(word == 2, w2, w3))


def random_bits_matrix(seed: int, stream: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """:func:`random_bits` of every element of ``[..., M, K]`` matrices, one Philox call per
    four elements: int64 ``[*stream.shape, M, K]`` in [0, 2^32), element ``(m, k)`` at index
    ``m * K + k``.

    Args:
        seed: user seed, 0 <= seed < 2^64.
        stream: int64 tensor of stream keys, one per matrix (any shape, may be 0-d).
        M, K: the matrix shape (M * K <= 2^32).

    Raises:
        ValueError: ``seed`` not an int in [0, 2^64), float stream keys, M or K not positive
            ints, or M * K > 2^32 (the element index is a 32-bit counter).
    """
    seed = _check_key(seed)
    if any(as_int(x) is None or x < 1 for x in (M, K)):
        raise ValueError(f"M and K must be positive ints, got M={M!r}, K={K!r}")
    M, K = int(M), int(K)
    if M * K > 2**32:
        raise ValueError(f"M * K = {M * K} elements exceed the 2^32 element indices of a "
                         f"matrix's SR stream (M={M}, K={K})")
    stream = _check_stream(stream)
    n = M * K
    calls = torch.arange((n + WORDS_PER_CALL - 1) // WORDS_PER_CALL, dtype=torch.int64,
                         device=stream.device)
    words = _calls(seed, stream[..., None], calls)  # 4 x [*lead, calls]
    out = torch.stack(words, dim=-1).flatten(-2)[..., :n]  # element 4c + w <- word w of c
    return out.reshape(*stream.shape, M, K)


def stream_keys_to(stream, device) -> torch.Tensor:
    """Integer stream keys (an int or an integer tensor) as int64 on ``device``. Keys are built
    on the host (:func:`stream_key`); a host tensor bound for CUDA goes through pinned memory
    with a non-blocking copy, since a copy from pageable memory makes the host wait for every
    queued kernel. Raises ValueError for keys that are not integers (:func:`_check_stream`)."""
    device = torch.device(device)
    t = _check_stream(stream)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        # staged in a block of PyTorch's caching host allocator (reused once the copy is
        # done), not t.pin_memory(): that asks the driver whether t is pinned, which took
        # 1.8 ms a call on the H200 machine (emulation_profile.py --host)
        buf = torch.empty(t.shape, dtype=torch.int64, pin_memory=True)
        buf.copy_(t)
        return buf.to(device, non_blocking=True)
    return t.to(device)


# Bit fields of a stream key (low to high). 63 bits in all, so the key is a positive int64.
STREAM_FIELDS: tuple[tuple[str, int], ...] = (
    ("copy", 1),  # 0 = recurrence anchor, 1 = read copy
    ("head", 10),
    ("layer", 8),
    ("sequence", 20),
    ("flush", 24),
)
#: bit offset of each field in a stream key (the running sum of the widths above)
STREAM_SHIFTS: dict[str, int] = {name: sum(w for _, w in STREAM_FIELDS[:i])
                                 for i, (name, _) in enumerate(STREAM_FIELDS)}


def stream_key(*, layer=0, sequence=0, head=0, flush=0, copy=0) -> torch.Tensor:
    """Pack (layer, sequence, head, flush index, copy) into one int64 stream key per matrix.

    Arguments are ints or integer tensors (broadcast together). ``copy`` is 0 for the
    recurrence anchor and 1 for the read copy, so the two casts of one flush draw
    independent bits (DESIGN.md section 3, "Flush").

    Raises:
        ValueError: a field is not an int or integer tensor (a float such as ``layer=1.5`` is
            refused, not truncated), is negative, or does not fit its bit width (see
            ``STREAM_FIELDS``).
    """
    values = dict(layer=layer, sequence=sequence, head=head, flush=flush, copy=copy)
    key = torch.zeros((), dtype=torch.int64)
    shift = 0
    for name, width in STREAM_FIELDS:
        v = _int64_values(values[name], f"stream field {name}")
        if v.numel() and (int(v.min()) < 0 or int(v.max()) >= (1 << width)):
            raise ValueError(
                f"stream field {name}={v.min().item()}..{v.max().item()} out of range "
                f"[0, {1 << width}) ({width} bits)"
            )
        key = key | (v << shift)
        shift += width
    return key
