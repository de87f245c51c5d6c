"""``replayssm-kl`` memory plan: what one rank needs on each of its devices, checked against
what the devices have, before any weight is loaded (``--dry-run`` prints it; every run
refuses a plan that does not fit with exit code 2). docs/distributed.md has the cost model.

The estimate is built from the model's config alone (a model on the ``meta`` device, no
weights) and the run's settings. Per rank:

* **weights**: parameter bytes in ``--dtype``; with ``--device-map auto`` split over the
  rank's GPUs as accelerate's ``infer_auto_device_map`` places them (the plan computes the
  very map the run then loads with, so both agree);
* **caches**: one per live (document, cell) pair and one per document for the FP32
  reference. A cache holds, per SSM layer, the ReplaySSM checkpoints (A and R dequantised in
  the working precision: one copy for single-checkpoint policies -- ``fp32``, ``shared:``,
  ``eager:`` -- two for ``read:/rec:``), the window buffer (L records; ``eager:`` has L = 1)
  and the conv state; and per attention layer the KV cache of N tokens. Cells of a document
  batch run in lockstep, so all their caches are live together;
* **logits**: one segment of reference logits (kept while every cell of the segment runs),
  the cell's own, the float64 chunks of the metrics, and for the stepwise check the emulated
  logits of the first K positions kept per document for the reference and every cell;
* **activations**: one forward call of the longest call (prefill or segment) through one
  layer: hidden states, MLP, the SSM mixer's projections; on CPU also the attention scores of
  the math path; and the window form's ``[rows, H, L, L]`` products (each window is padded to
  its full L, so this term grows with L squared even where L exceeds N);
* a fixed overhead per process (CUDA context and allocator slack, or the Python process).

It is an estimate (allocator fragmentation and library workspaces are not modelled); the
budget of a device is its free memory when the plan is made (CUDA), or the available memory
of the node divided among its ranks (CPU), or ``--memory-budget``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .run import BadArgs

__all__ = ["ModelShape", "model_shape", "cache_bytes", "RankPlan", "plan_rank", "device_budget",
           "infer_device_map", "format_bytes", "GIB"]

GIB = 1 << 30
#: per-process memory not modelled: CUDA context, NCCL buffers, allocator slack (GPU) ...
CUDA_OVERHEAD = 2 * GIB
#: ... or the interpreter with torch and transformers loaded (CPU)
CPU_OVERHEAD = GIB // 2


def format_bytes(n: float) -> str:
    """``n`` bytes as MiB below 1 GiB, else GiB (one decimal)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


@dataclass
class ModelShape:
    """What the plan needs to know of a model, read from its config (meta device)."""

    params: int
    bytes_per: int
    work_bytes: int
    mixers: list  # (family, H, V, K, conv_dim, conv_kernel) per SSM layer
    attention_layers: int
    kv_heads: int
    head_dim: int
    attention_heads: int
    hidden: int
    intermediate: int
    vocab: int
    meta_model: object = field(default=None, repr=False)

    @property
    def weights_bytes(self) -> int:
        return self.params * self.bytes_per


_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def model_shape(cfg, dtype: str) -> ModelShape:
    """The :class:`ModelShape` of ``cfg`` in ``dtype`` (``float32``, ``bfloat16``, ...), from a
    model built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from replayssm_quant.adapters import find_ssm_mixers
    from replayssm_quant.adapters import gdn as G
    from replayssm_quant.adapters import mamba2 as M

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    mixers = []
    for _, mixer, fam in find_ssm_mixers(model):
        H, V, K = (M.dims(mixer) if fam == "mamba2" else G.dims(mixer))
        mixers.append((fam, H, V, K, int(mixer.conv_dim), int(mixer.conv_kernel_size)))
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text, "num_attention_heads", None) or 0
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // max(1, heads))
    n_attn = sum(1 for m in model.modules() if type(m).__name__.endswith("Attention"))
    inter = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    return ModelShape(params=sum(p.numel() for p in model.parameters()), bytes_per=_BYTES[dtype],
                      work_bytes=8 if dtype == "float64" else 4, mixers=mixers,
                      attention_layers=n_attn, kv_heads=kv_heads, head_dim=head_dim,
                      attention_heads=heads, hidden=text.hidden_size, intermediate=inter,
                      vocab=text.vocab_size, meta_model=model)


def cache_bytes(shape: ModelShape, config, n_tokens: int) -> dict:
    """Bytes of one document's cache under one cell's parsed ``StateConfig``: ``state``
    (checkpoints A and R), ``records`` (the window buffer, L records of the effective
    window), ``conv`` and ``kv`` (N tokens), and their ``total``."""
    copies = 1 if config.policy.single_checkpoint else 2
    L = config.window
    w = shape.work_bytes
    state = records = conv = 0
    for _fam, H, V, K, conv_dim, kernel in shape.mixers:
        state += copies * H * V * K * w
        records += L * H * (2 * V + K + 2) * w  # GDN: la, beta, v, k, read-path u (Mamba-2: less)
        conv += conv_dim * kernel * shape.bytes_per
    kv = shape.attention_layers * 2 * n_tokens * shape.kv_heads * shape.head_dim * shape.bytes_per
    return {"state": state, "records": records, "conv": conv, "kv": kv,
            "total": state + records + conv + kv}


@dataclass
class RankPlan:
    """One rank's share of the run and its memory per device (bytes)."""

    rank: int
    devices: list
    pairs: int
    documents: int
    live_cells: int
    live_caches: int
    weights: dict
    caches: int
    logits: int
    activations: int
    overhead: int
    budget: dict
    device_map: dict | None = None
    problem: str = ""

    def total(self, dev) -> int:
        """Estimated peak bytes on device ``dev``."""
        g = len(self.devices)
        return (self.weights.get(dev, 0) + self.caches // g + self.logits + self.activations
                + self.overhead)

    @property
    def fits(self) -> bool:
        return not self.problem and all(self.total(d) <= self.budget[d] for d in self.devices)

    def why(self) -> str:
        """Why the plan does not fit ('' when it does)."""
        if self.problem:
            return self.problem
        bad = [d for d in self.devices if self.total(d) > self.budget[d]]
        if not bad:
            return ""
        d = bad[0]
        return (f"rank {self.rank} needs about {format_bytes(self.total(d))} on {d} (weights "
                f"{format_bytes(self.weights.get(d, 0))}, {self.live_caches} caches "
                f"{format_bytes(self.caches // len(self.devices))}, logits {format_bytes(self.logits)}, "
                f"activations {format_bytes(self.activations)}, overhead {format_bytes(self.overhead)}) "
                f"but its budget is {format_bytes(self.budget[d])}")


def device_budget(device: str, local_world_size: int, override_gib: float | None) -> int:
    """Bytes one rank may use on ``device``: ``--memory-budget`` if given, else the free memory
    of a GPU, or the node's available memory divided by its ranks (CPU)."""
    if override_gib is not None:
        return int(override_gib * GIB)
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 1 << 62  # unknown: do not refuse
    return avail // max(1, local_world_size)


def infer_device_map(shape: ModelShape, weight_budget: dict) -> dict:
    """accelerate's placement (``device_map="auto"``: balanced over the GPUs) of the model's
    modules on the GPUs ``weight_budget`` names (``{gpu index: bytes for weights}``), as
    transformers computes it for ``from_pretrained(device_map="auto", max_memory=...)``.
    Modules that do not fit are mapped to ``"cpu"``/``"disk"`` (the caller refuses that)."""
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map

    model = shape.meta_model
    no_split = getattr(model, "_no_split_modules", None) or []
    budget = {int(k): max(0, int(v)) for k, v in weight_budget.items()}
    balanced = get_balanced_memory(model, max_memory=dict(budget), no_split_module_classes=no_split)
    balanced = {k: min(v, budget[k]) if k in budget else v for k, v in balanced.items()}
    return dict(infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split))


def _weights_per_device(shape: ModelShape, device_map: dict) -> dict:
    """Parameter bytes each device of ``device_map`` receives (module prefix -> device)."""
    model = shape.meta_model
    out: dict = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights counted once
            continue
        seen.add(id(p))
        dev, best = None, -1
        for prefix, d in device_map.items():
            if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                dev, best = d, len(prefix)
        key = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out


def plan_rank(rank: int, shape: ModelShape, a, pairs: list, cell_configs: list, ref_config,
              devices: list, budget: dict, device_map_gpus: list | None = None) -> RankPlan:
    """The memory plan of one rank.

    Args:
        pairs: the rank's ``(document index, cell index)`` pairs (its shard).
        cell_configs: parsed ``StateConfig`` of every cell, by cell index.
        ref_config: the reference's ``StateConfig``.
        devices: the rank's devices (``["cpu"]``, ``["cuda:0"]``, or its GPU group).
        budget: bytes per device (:func:`device_budget`).
        device_map_gpus: the GPU indices of ``--device-map auto`` on CUDA (None otherwise):
            the weights are placed with :func:`infer_device_map` in what the budget leaves.
    """
    N, P, S, B, K = a.max_tokens, a.prefill, a.segment_len, a.batch_size, a.stepwise_check or 0
    by_doc: dict = {}
    for d, c in pairs:
        by_doc.setdefault(d, []).append(c)
    docs = sorted(by_doc)
    batches = [docs[i:i + B] for i in range(0, len(docs), B)]
    ref_cache = cache_bytes(shape, ref_config, N)["total"]
    per_cell = [cache_bytes(shape, c, N)["total"] for c in cell_configs]
    caches = live_cells = live_caches = 0
    kept = 0
    rows = 0
    G = getattr(a, "cells_per_pass", 0) or 0
    for batch in batches:
        # the batch's cells (union over its documents) run in passes of G; a pass holds, per
        # document, the reference cache and the caches of its cells in that pass
        union = sorted({c for d in batch for c in by_doc[d]})
        passes = [union[i:i + G] for i in range(0, len(union), G)] if G else [union]
        for pc in passes:
            lock = sum(ref_cache + sum(per_cell[c] for c in by_doc[d] if c in pc) for d in batch)
            n_cells = sum(1 for d in batch for c in by_doc[d] if c in pc)
            caches = max(caches, lock)
            live_cells = max(live_cells, n_cells)
            live_caches = max(live_caches, len(batch) + n_cells)
            kept = max(kept, (len(batch) + n_cells) * K * shape.vocab * 4)
        if K:
            caches = max(caches, 2 * len(batch) * max([ref_cache] + per_cell))
        rows = max(rows, len(batch))
    T = max(P, min(S, N - P))  # the longest forward call: the prefill or a segment
    seg_logits = rows * T * shape.vocab
    logits = 0
    if pairs:
        # reference segment (model dtype) + the cell's logits (one row at a time, concatenated)
        # + float64 metric temporaries (chunks of 2^24 logits, metrics.CHUNK_ELEMENTS)
        logits = (seg_logits * shape.bytes_per * 3 + 6 * 8 * min(seg_logits, 1 << 24)
                  + kept + (3 * K * shape.vocab * 8 if K else 0))
    widest = max([H * (2 * V + 2 * K + 2) for _f, H, V, K, _c, _k in shape.mixers] + [0])
    act = T * (12 * shape.hidden + 4 * shape.intermediate + 4 * widest) * shape.work_bytes
    if devices and devices[0] == "cpu" and shape.attention_layers:
        act += T * N * shape.attention_heads * shape.work_bytes  # math-path attention scores
    # the window form pads each window to its full L (replay/window.py, "Invariance"), and its
    # solve and outputs hold a few [rows, H, L, L] tensors (GDN's k.k and q.k products, Mamba-2's
    # decay differences): quadratic in L, whatever N is
    Lmax = max([c.window for c in cell_configs] + [ref_config.window])
    heads = max([H for _f, H, _v, _k, _c, _n in shape.mixers] + [0])
    act += 4 * rows * heads * Lmax * Lmax * shape.work_bytes
    activations = act if pairs else 0
    cuda = bool(devices) and devices[0].startswith("cuda")
    overhead = CUDA_OVERHEAD if cuda else CPU_OVERHEAD
    plan = RankPlan(rank, list(devices), len(pairs), len(docs), live_cells, live_caches, {},
                    caches, logits, activations, overhead, dict(budget))
    if not pairs:  # nothing to compute: the rank loads no weights
        plan.overhead = overhead
        return plan
    if device_map_gpus is None:
        plan.weights = {devices[0]: shape.weights_bytes}
        return plan
    g = len(device_map_gpus)
    room = {i: budget[f"cuda:{i}"] - (caches // g + logits + activations + overhead)
            for i in device_map_gpus}
    if any(v <= 0 for v in room.values()):
        i = min(room, key=room.get)
        plan.problem = (f"rank {rank}: caches, logits and activations alone (about "
                        f"{format_bytes(caches // g + logits + activations + overhead)} per GPU) "
                        f"exceed the budget of cuda:{i} ({format_bytes(budget[f'cuda:{i}'])})")
        return plan
    dmap = infer_device_map(shape, room)
    plan.device_map = dmap
    off = sorted({str(v) for v in dmap.values() if not isinstance(v, int)})
    if off:
        plan.problem = (f"rank {rank}: the weights ({format_bytes(shape.weights_bytes)}) do not fit "
                        f"on its {g} GPU(s) cuda:{','.join(map(str, device_map_gpus))} next to the "
                        f"caches, logits and activations (accelerate would offload modules to "
                        f"{' and '.join(off)})")
    plan.weights = _weights_per_device(shape, dmap)
    return plan


def check_budget_arg(value) -> None:
    """``--memory-budget`` must be finite and > 0 (GiB)."""
    import math

    if value is not None and not (value > 0 and math.isfinite(value)):
        raise BadArgs(f"--memory-budget must be finite and > 0 (GiB per device), got {value}")
