"""Policy maps in ``replayssm-kl`` (issue 18; docs/planner.md): a map's cell before the model
is loaded, and maps resolved against the model's structure from its config alone (a model on
the ``meta`` device), for the argument checks and the manifest."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["MapCellConfig", "cell_config", "ssm_layout", "decays_for", "resolve_maps"]


@dataclass(frozen=True)
class MapCellConfig:
    """What the work plan needs of a policy-map cell before any model is loaded: its window,
    seed, whether some policy of the map draws random bits, and whether all keep one
    checkpoint (``policy`` is the :class:`~replayssm_quant.policymap.PolicyMap`). The run
    replaces it by the map resolved against the loaded model (``handle.build_config``)."""

    policy: object
    window: int
    seed: int

    @property
    def uses_sr(self) -> bool:
        return self.policy.uses_sr


def cell_config(policy, window: int, seed: int, fold):
    """The config of one cell before the model is loaded: ``StateConfig.build`` for a policy,
    :class:`MapCellConfig` for a policy map (``policy``: parsed, or a string as
    :func:`~replayssm_quant.policymap.parse_state_arg` takes it, e.g. a cell's ``map:...``)."""
    from replayssm_quant.config import StateConfig
    from replayssm_quant.policymap import PolicyMap, parse_state_arg

    p = parse_state_arg(policy)
    if isinstance(p, PolicyMap):
        return MapCellConfig(p, window, seed)
    return StateConfig.build(p, window=window, seed=seed, fold=fold)


def ssm_layout(cfg) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """``({layer: state heads}, {layer: (V, K)})`` of a model's SSM layers, from ``cfg`` (a
    weightless copy on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from replayssm_quant.adapters import find_ssm_mixers
    from replayssm_quant.adapters import gdn as G
    from replayssm_quant.adapters import mamba2 as M

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    heads, dims = {}, {}
    for _, m, fam in find_ssm_mixers(model):
        H, V, K = M.dims(m) if fam == "mamba2" else G.dims(m)
        heads[int(m.layer_idx)] = H
        dims[int(m.layer_idx)] = (V, K)
    return heads, dims


def decays_for(decay_stats, cfg_path):
    """Per-head mean decays of a run: ``decay_stats`` (a file), else the model directory's
    ``decay_stats.json``, else None."""
    from replayssm_quant.adapters import DECAY_STATS_FILE
    from replayssm_quant.policymap import load_decay_stats

    src = decay_stats
    if src is None and os.path.isfile(os.path.join(str(cfg_path), DECAY_STATS_FILE)):
        src = os.path.join(str(cfg_path), DECAY_STATS_FILE)
    return load_decay_stats(src) if src is not None else None


def resolve_maps(policies, cfg, cfg_path, decay_stats=None) -> dict:
    """``{canonical map text: {"name", "map", "resolved": {layer: policy}}}`` for every policy
    map among ``policies``, resolved against the model of ``cfg`` (per-head groups spelled out).

    Raises:
        ValueError: a map naming a layer or head the model does not have, or decay buckets
            without decays (the message names the map).
    """
    from replayssm_quant.policymap import PolicyMap

    maps = [p for p in policies if isinstance(p, PolicyMap)]
    if not maps:
        return {}
    heads, _ = ssm_layout(cfg)
    decay = decays_for(decay_stats, cfg_path) if any(m.uses_decay for m in maps) else None
    out = {}
    for m in maps:
        try:
            res = m.resolve(heads, decay)
        except ValueError as e:
            raise ValueError(f"{e} (in {m})") from None
        out[str(m)] = {"name": m.name, "map": m.to_dict(),
                       "resolved": {str(i): str(p) for i, p in sorted(res.items())}}
    return out
