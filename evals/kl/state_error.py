"""Per-layer, per-head recurrent-state error of a cell against the fp32 reference
(``replayssm-kl --state-error``; ``state_error.parquet``).

At the first segment end of every octave of N and at the end of the document (``position`` =
tokens consumed), where both the cell's and the reference's state sit on a flush
(``h == 0``: the checkpoints describe the same token), the runner compares, for every SSM layer
and head, the cell's read copy R and recurrence anchor A with the reference's exact state S
(the fp32 policy's anchor, which is the unrounded recurrence):

    err_read   = ||R - S||_F / ||S||_F        err_anchor = ||A - S||_F / ||S||_F

over the head's ``[V, K]`` state matrix (float64 norms). Both runs see the same tokens (teacher
forcing), so the error is the state format's rounding plus what upstream layers' errors did to
this layer's inputs. Next to it: the head's mean per-token decay alpha and mean GDN write
strength beta over the tokens so far, measured on the reference run (``decay``: the
arithmetic mean of alpha_t; ``log_decay``: the mean of log alpha_t, whose exponential -- the
geometric mean, smaller -- is the per-token factor of a product over many tokens)
(:meth:`replayssm_quant.adapters.state.LayerState.input_stats`) -- the x axis of the paper's
decay argument (arXiv 2610.13778, appendix C.6: slow-decay heads accumulate rounding error,
``analysis.theory``).
"""

from __future__ import annotations

import math

__all__ = ["STATE_ERROR_COLUMNS", "state_error_rows"]

STATE_ERROR_COLUMNS = ("doc", "position", "policy", "window", "seed", "layer", "head",
                       "err_read", "err_anchor", "state_norm", "decay", "log_decay", "beta",
                       "nonfinite")


def _rel(x, ref, ref_norm):
    """Per-head relative Frobenius error of ``x [1, H, V, K]`` against ``ref`` (float64 ``[H]``)."""
    d = (x.double() - ref.double()).flatten(2).norm(dim=2)[0]
    return d / ref_norm


def state_error_rows(ref_states: dict, states: dict, position: int) -> list:
    """Rows (dicts, without the cell and document keys) for one document after ``position``
    tokens: one per (layer, head) of the layers whose cell and reference states both sit on a
    flush (none when they do not: the runner refuses ``--state-error`` unless every window
    divides ``--segment-len``). ``ref_states`` / ``states``: ``{layer_idx: LayerState}`` of a batch-of-1 cache each
    (``StatePolicyHandle.states(cache)``). A head whose reference norm is 0 gets NaN errors;
    non-finite cell states are recorded (``nonfinite``), not dropped.

    Raises:
        ValueError: the two caches hold states of different layers or shapes.
    """
    if set(ref_states) != set(states):
        raise ValueError(f"reference holds state for layers {sorted(ref_states)}, the cell for "
                         f"{sorted(states)}")
    rows = []
    for layer in sorted(states):
        st, ref = states[layer], ref_states[layer]
        if st.anchor.shape != ref.anchor.shape or st.anchor.shape[0] != 1:
            raise ValueError(f"layer {layer}: cell state {tuple(st.anchor.shape)} vs reference "
                             f"{tuple(ref.anchor.shape)}; expected equal shapes with batch 1")
        if st.h != 0 or ref.h != 0:  # checkpoints of different tokens: nothing to compare
            continue
        S = ref.anchor
        norm = S.double().flatten(2).norm(dim=2)[0]
        safe = norm.where(norm > 0, norm.new_tensor(math.nan))
        er = _rel(st.read, S, safe).cpu().tolist()
        ea = _rel(st.anchor, S, safe).cpu().tolist()
        bad = (~(st.read.isfinite().flatten(2).all(2) & st.anchor.isfinite().flatten(2).all(2)))[0]
        stats = ref.input_stats()
        dec, ldec, beta = (stats[k][0].cpu().tolist() for k in ("decay", "log_decay", "beta"))
        for h, n in enumerate(norm.cpu().tolist()):
            rows.append({"position": int(position), "layer": int(layer), "head": h,
                         "err_read": er[h], "err_anchor": ea[h], "state_norm": n,
                         "decay": dec[h], "log_decay": ldec[h], "beta": beta[h],
                         "nonfinite": bool(bad[h])})
    return rows
