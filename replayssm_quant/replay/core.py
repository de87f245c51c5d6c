"""Pure torch reference functions of ReplaySSM (DESIGN.md section 3).

These are the readable references that the state objects (:mod:`.mamba2`, :mod:`.gdn`), the
teacher-forced window form (:mod:`.window`) and the Triton kernels all have to match. They
know nothing about ring buffers, policies' bookkeeping or validation; they take plain tensors.

Conventions (shared by every function here):

* A state / checkpoint is ``[B, H, V, K]`` in "value x key" orientation, so the output is
  ``o = S q`` and blocked formats (nvfp4, mx) run their blocks along the key axis (last dim).
  Mamba-2: ``[B, H, P, N]`` (head dim x d_state), the Hugging Face ``ssm_state`` layout.
  GDN: ``[B, HV, DV, DK]``; note fla stores its recurrent state as ``[B, H, K, V]`` (the
  transpose), so convert with ``.transpose(-1, -2)`` at that boundary.
* Buffer records are *head-expanded* (grouped B/C or grouped q/k repeated to the value heads
  the way Hugging Face / fla do, ``repeat_interleave`` over the head dim) and stacked along a
  window axis ``J`` after the batch axis, fla style:
  ``la [B, J, H]`` log decay (Mamba-2: ``dt * A``; GDN: ``g``), ``w [B, J, H, V]`` the value
  written (Mamba-2: ``v = dt * x``; GDN: the correction ``u``), ``k [B, J, H, K]``,
  ``q [B, H, K]`` (one token) or ``[B, J, H, K]`` (a window), ``beta [B, J, H]`` (GDN).
* Decay products ``gamma_{i:j} = exp(c_j - c_{i-1})`` with ``c = cumsum(la)`` along J.
* Everything runs in the dtype of its inputs (float32 or float64). Casting to a storage
  format goes through :func:`cast_state`: formats other than ``fp32`` round in FP32 (a float64
  state is cast to float32 first by the quantizer, so a stored state has FP32 precision at
  most) and the dequantised values come back in the working dtype; ``fp32`` is treated as
  "no rounding" and keeps the input dtype (float64 stays float64).
"""

from __future__ import annotations

import functools

import torch

# The flush's data types, stream keys and length mask live in the leaf module
# replayssm_quant.checkpoints (shared with the kernels); re-exported here.
from ..checkpoints import (ANCHOR_COPY, PREFILL_FLUSH_INDEX, READ_COPY,  # noqa: F401
                           Checkpoints, FlushResult, checkpoint_streams, length_mask)
from ..formats import QuantSpec
from ..policy import StatePolicy, require_layer_policy, require_policy  # noqa: F401 (re-exported)
from ..quant import pack, quantize


# ------------------------------------------------------------------------------ invariance
def per_sequence(fn):
    """Run a reference reduction one sequence at a time (batch-invariant arithmetic).

    Every tensor argument of ``fn`` is batched along dim 0 (``[B, ...]``). On CPU (any tensor
    not on CUDA) with ``B > 1``, ``fn`` is called once per sequence on ``[1, ...]`` slices and
    the results (a tensor, or a tuple of tensors) are joined along dim 0, so a sequence's
    result is the same bits whatever batch or batch position it comes in: each call has the
    same shapes and strides as the sequence alone, and BLAS picks its kernel (hence its
    summation order) by shape and stride, never by value. On CUDA the batched call runs (the
    kernels are the fast path there; ``docs/invariance.md`` says what is checked on the
    device). Issue 12, item 1.

    Only reductions need this: elementwise products and sums are exactly rounded, and the
    transcendental ops here (``exp``) run inside the split functions (on CPU their
    vectorised and scalar-tail code paths can differ in the last bit, and which elements fall
    in the tail depends on the tensor's total size).
    """

    @functools.wraps(fn)
    def wrapper(first, *args, **kwargs):
        B = first.shape[0]
        if B <= 1 or first.is_cuda:
            return fn(first, *args, **kwargs)

        def row(a, b):
            return a[b: b + 1] if isinstance(a, torch.Tensor) else a

        parts = [fn(first[b: b + 1], *(row(a, b) for a in args),
                    **{n: row(a, b) for n, a in kwargs.items()}) for b in range(B)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(p) for p in zip(*parts))
        return torch.cat(parts)

    return wrapper


# ------------------------------------------------------------------------------ small helpers
@per_sequence
def matvec(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``S x`` for ``S [B, ..., V, K]`` and ``x [B, ..., K]`` -> ``[B, ..., V]`` (one matmul per
    matrix; :func:`per_sequence`)."""
    return torch.matmul(S, x.unsqueeze(-1)).squeeze(-1)


def expand_heads(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Repeat grouped heads to ``heads`` along ``dim`` (``repeat_interleave``, as HF and fla do:
    head ``h`` uses group ``h // (heads // groups)``)."""
    groups = t.shape[dim]
    if groups == heads:
        return t
    return t.repeat_interleave(heads // groups, dim=dim)


def mask_records(length: torch.Tensor | None, la: torch.Tensor, *rest: torch.Tensor):
    """Neutralise records at slots ``>= length[b]``: log decay 0 (decay 1) and zeros for the
    other record tensors (``w``, ``beta``: no contribution). ``length=None`` keeps everything."""
    if length is None:
        return (la, *rest)
    live = length_mask(length, la.shape[1])
    out = [torch.where(live[:, :, None], la, torch.zeros((), dtype=la.dtype))]
    for t in rest:
        shape = live.shape + (1,) * (t.dim() - 2)
        out.append(torch.where(live.view(shape), t, torch.zeros((), dtype=t.dtype)))
    return tuple(out)


# ------------------------------------------------------------------------------ casting
def cast_state(S: torch.Tensor, spec: QuantSpec, *, seed: int, stream, store: bool = False):
    """Round ``S [B, H, V, K]`` to ``spec`` (one FP32 scale per ``[V, K]`` matrix where the
    format has one; blocks along K).

    Returns ``(values, stored)``: ``values`` are the dequantised values in ``S.dtype``;
    ``stored`` is the real storage when ``store`` is true (a :class:`PackedTensor`, or ``S``
    itself for ``fp32``), else None. ``pack(...).dequantize()`` equals ``quantize(...)`` bit
    for bit (quantizer contract), so stored and fake-quantised paths round identically.
    """
    if spec.is_identity:
        return S, (S if store else None)
    if store:
        packed = pack(S, spec, seed=seed, stream=stream)
        return packed.dequantize().to(S.dtype), packed
    return quantize(S, spec, seed=seed, stream=stream).to(S.dtype), None


def cast_checkpoints(S: torch.Tensor, policy, *, seed: int, layer: int,
                     sequence_ids: torch.Tensor, flush_index: torch.Tensor,
                     store: bool = False) -> Checkpoints:
    """The flush cast: ``A <- Q_rec(S)``, ``R <- Q_read(S)``, two independent casts of the same
    unrounded ``S`` (R is never derived from the rounded A), each with its own SR stream
    (copy bit 0 / 1). Single-checkpoint policies (``fp32``, ``shared``, ``eager``) cast once,
    with the anchor stream, and return R = A.

    A :class:`~replayssm_quant.policy.HeadPolicy` (one layer of a per-head policy map) casts
    each head group's slice ``S[:, a:b]`` under its own policy with the same stream keys those
    heads have under a uniform policy (keys are per head; scales per ``[V, K]`` matrix), so a
    head's stored values equal the uniform policy's bit for bit. R is A where every group keeps
    one checkpoint; otherwise R is assembled per group (R = A on single-checkpoint groups).
    ``store=True`` then returns one stored form per group (a tuple, head order).

    Args:
        S: unrounded state ``[B, H, V, K]``.
        policy: a parsed :class:`~replayssm_quant.policy.StatePolicy` or ``HeadPolicy``
            (parse at the edges).
        sequence_ids, flush_index: int64 ``[B]``.

    Raises:
        TypeError: ``policy`` is not parsed.
    """
    require_layer_policy(policy)
    sa, sr = checkpoint_streams(layer=layer, sequence_ids=sequence_ids, heads=S.shape[1],
                                flush_index=flush_index)
    if isinstance(policy, StatePolicy):
        return _cast_pair(S, policy, seed, sa, sr, store)
    if policy.heads != S.shape[1]:
        raise ValueError(f"per-head policy {policy} covers {policy.heads} heads, the state has "
                         f"{S.shape[1]}")
    parts = [_cast_pair(S[:, a:b], p, seed, sa[:, a:b], sr[:, a:b], store)
             for a, b, p in policy.groups]
    anchor = torch.cat([c.anchor for c in parts], 1)
    read = anchor if policy.single_checkpoint else torch.cat([c.read for c in parts], 1)
    if not store:
        return Checkpoints(anchor, read)
    return Checkpoints(anchor, read, tuple(c.anchor_stored for c in parts),
                       tuple(c.read_stored for c in parts))


def _cast_pair(S, policy: StatePolicy, seed: int, sa, sr, store: bool) -> Checkpoints:
    """The two casts of one :class:`StatePolicy` with stream keys ``sa``/``sr`` ``[B, H]``."""
    a, a_st = cast_state(S, policy.rec, seed=seed, stream=sa, store=store)
    if policy.single_checkpoint:
        return Checkpoints(a, a, a_st, a_st)
    r, r_st = cast_state(S, policy.read, seed=seed, stream=sr, store=store)
    return Checkpoints(a, r, a_st, r_st)


# ------------------------------------------------------------------------------ recurrences
@per_sequence
def reconstruct(C: torch.Tensor, la: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``S_J = gamma_{1:J} C + sum_{j<=J} gamma_{j+1:J} w_j k_j^T`` (materialises the state).

    Args: ``C [B, H, V, K]``, ``la [B, J, H]``, ``w [B, J, H, V]``, ``k [B, J, H, K]``.
    Returns ``[B, H, V, K]``. ``J = 0`` returns ``C``.
    """
    if la.shape[1] == 0:
        return C
    c = la.cumsum(1)
    total = c[:, -1]  # [B, H]
    m = torch.exp(total[:, None, :] - c)  # gamma_{j+1:J}, [B, J, H]
    wm = (w * m[..., None]).permute(0, 2, 3, 1)  # [B, H, V, J]
    kt = k.permute(0, 2, 1, 3)  # [B, H, J, K]
    return torch.exp(total)[..., None, None] * C + torch.matmul(wm, kt)


@per_sequence
def step_output(R: torch.Tensor, la: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                q: torch.Tensor) -> torch.Tensor:
    """Output-only step: ``o = gamma_{1:h} (R q) + W (m * (K^T q))``, ``m_j = gamma_{j+1:h}``,
    for the last of the ``h = J`` records (the current token is record ``h``). Never forms S.

    Args: ``R [B, H, V, K]``, records ``la [B, J, H]``, ``w [B, J, H, V]``, ``k [B, J, H, K]``
    (J >= 1), ``q [B, H, K]``. Returns ``[B, H, V]``.
    """
    c = la.cumsum(1)
    total = c[:, -1]
    m = torch.exp(total[:, None, :] - c)  # [B, J, H]
    kq = (k * q[:, None]).sum(-1)  # [B, J, H]
    return torch.exp(total)[..., None] * matvec(R, q) + ((m * kq)[..., None] * w).sum(1)


@per_sequence
def window_outputs(C: torch.Tensor, la: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                   q: torch.Tensor) -> torch.Tensor:
    """Outputs of every position of a window read from checkpoint ``C`` (output-only, causal):
    ``o_t = gamma_{1:t} (C q_t) + sum_{j<=t} gamma_{j+1:t} (k_j . q_t) w_j``.

    Args: ``C [B, H, V, K]``, ``la [B, J, H]``, ``w [B, J, H, V]``, ``k, q [B, J, H, K]``.
    Returns ``[B, J, H, V]``.
    """
    J = la.shape[1]
    c = la.cumsum(1)  # [B, J, H]
    causal = torch.ones(J, J, dtype=torch.bool, device=la.device).tril()  # [t, j]: j <= t
    diff = c[:, :, None, :] - c[:, None, :, :]  # [B, t, j, H]
    neg_inf = torch.full((), float("-inf"), dtype=la.dtype, device=la.device)  # no host copy
    dec = torch.exp(torch.where(causal[None, :, :, None], diff, neg_inf))  # gamma_{j+1:t}
    qk = torch.einsum("bthk,bjhk->btjh", q, k)
    intra = torch.einsum("btjh,bjhv->bthv", dec * qk, w)
    Cq = torch.einsum("bhvk,bthk->bthv", C, q)
    return torch.exp(c)[..., None] * Cq + intra


def draft_outputs(C: torch.Tensor, la: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                  q: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Verify reference (output-only): outputs of ``T`` drafts sitting at slots
    ``start[b] .. start[b] + T - 1`` of the records, read from checkpoint ``C``; records before
    ``start`` are the committed ones. Never materialises a state.

    Args: ``C [B, H, V, K]``; records ``la [B, J, H]``, ``w [B, J, H, V]``, ``k [B, J, H, K]``
    with ``J >= max(start) + T`` (slots after a sequence's last draft are ignored: causal);
    ``q [B, T, H, K]``; ``start`` int64 ``[B]``. Returns ``[B, T, H, V]``.
    """
    B, T = q.shape[:2]
    J = la.shape[1]
    pos = start[:, None] + torch.arange(T, device=q.device)[None, :]
    b = torch.arange(B, device=q.device)[:, None]
    Q = q.new_zeros(B, J, *q.shape[2:])
    Q[b, pos] = q
    return window_outputs(C, la, w, k, Q)[b, pos]


@per_sequence
def solve_corrections(C: torch.Tensor, la: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                      k: torch.Tensor, *, start: torch.Tensor | None = None,
                      u_known: torch.Tensor | None = None, stop: int | None = None) -> torch.Tensor:
    """GDN corrections of a run of records against checkpoint ``C``: the unit lower-triangular
    system (DESIGN.md section 3, "Flush")

        u_j + sum_{i<j} beta_j gamma_{i+1:j} (k_i . k_j) u_i = beta_j (v_j - gamma_{1:j} C k_j).

    ``start=None`` solves all rows in one triangular solve (``torch.linalg.solve_triangular``;
    row ``j`` depends only on rows ``<= j``, and the solve's summation order only on ``J``, so
    records appended after row ``j`` -- or zero padding -- never change its bits).
    With ``start``, rows ``j < start[b]`` are taken from ``u_known`` (already computed
    corrections, e.g. the committed read-path ones when solving for drafts) and rows
    ``start..J-1`` are solved by forward substitution against them.

    Rows ``j >= stop`` are returned as zero (a window padded to its full length whose later
    slots are still empty).

    Args: ``C [B, H, V, K]``, ``la, beta [B, J, H]``, ``v [B, J, H, V]``, ``k [B, J, H, K]``,
    ``start`` int64 ``[B]``, ``u_known [B, >=J, H, V]``, ``stop`` int (default J).
    Returns ``u [B, J, H, V]``.
    """
    B, J, H = la.shape
    u = torch.zeros_like(v)
    if J == 0:
        return u
    c = la.cumsum(1)
    Ck = torch.matmul(C, k.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # C k_j: [B, J, H, V]
    rhs = beta[..., None] * (v - torch.exp(c)[..., None] * Ck)
    kk = torch.einsum("bihk,bjhk->bjih", k, k)  # [B, j, i, H]: k_i . k_j
    if start is None:
        strict = torch.ones(J, J, dtype=torch.bool, device=la.device).tril(-1)[None, :, :, None]
        neg_inf = torch.full((), float("-inf"), dtype=la.dtype, device=la.device)  # no host copy
        decay = torch.exp(torch.where(strict, c[:, :, None, :] - c[:, None, :, :], neg_inf))
        low = (beta[:, :, None, :] * decay * kk).permute(0, 3, 1, 2)  # [B, H, j, i], i < j
        eye = torch.eye(J, dtype=la.dtype, device=la.device)
        u = torch.linalg.solve_triangular(eye + low, rhs.permute(0, 2, 1, 3), upper=False,
                                          unitriangular=True).permute(0, 2, 1, 3)
        if stop is not None and stop < J:
            u[:, stop:] = 0
        return u
    first = int(start.min().clamp(0, J))
    u[:, :first] = u_known[:, :first]
    for j in range(first, J if stop is None else min(stop, J)):
        acc = rhs[:, j]
        if j > 0:
            coef = beta[:, j, None, :] * torch.exp(c[:, j, None, :] - c[:, :j]) * kk[:, j, :j]  # [B, i, H]
            acc = acc - (coef[..., None] * u[:, :j]).sum(1)
        known = (j < start).view(B, 1, 1)
        u[:, j] = torch.where(known, u_known[:, j], acc)
    return u


# ------------------------------------------------------------------------------ flush
def flush(anchor: torch.Tensor, la: torch.Tensor, w: torch.Tensor, k: torch.Tensor, policy, *,
          seed: int, layer: int, sequence_ids: torch.Tensor, flush_index: torch.Tensor,
          store: bool = False) -> FlushResult:
    """THE flush routine (used by the state objects, the teacher-forced window form and, as the
    reference, by the flush kernel): reconstruct ``S`` in the working precision from the
    dequantised anchor and the committed records, then cast A and R independently from it
    (:func:`cast_checkpoints`). Mamba-2 passes ``w = v``; GDN passes the corrections from
    :func:`solve_corrections` against the anchor (or, in the cached-fold variant, the cached
    read-path corrections). Records beyond a sequence's committed count must be neutralised
    first (:func:`mask_records`).
    """
    S = reconstruct(anchor, la, w, k)
    cps = cast_checkpoints(S, policy, seed=seed, layer=layer, sequence_ids=sequence_ids,
                           flush_index=flush_index, store=store)
    return FlushResult(S, cps, w)
