"""``replayssm-kl``: teacher-forced per-position KL of state policies against FP32-state decoding.

For every document, the reference (the same model under the ``fp32`` state policy) and every
(policy, window, seed) cell run in lockstep, one segment of ``--segment-len`` tokens at a time,
each with its own cache (ReplaySSM state, conv state and attention KV cache carried across
segments). The reference logits of a segment are computed once and shared by all cells; KL and
the other metrics are reduced on the fly, so logits are never stored whole.

KL is computed in float64 and is >= 0 by construction; a non-finite value on either side is
recorded (``nonfinite_ref`` / ``nonfinite_policy``) and counted, never dropped silently
(:mod:`replayssm_quant.evals.kl.metrics`). Documents get BOS as the tokenizer's own default, like lm-eval's
HFLM (``--add-bos-token``, :mod:`replayssm_quant.evals.kl.documents`). The first ``--stepwise-check K``
positions of every cell are also decoded token by token, and KL(stepping || emulation) -- the
float32 path noise of teacher-forced emulation -- is reported next to the policy's KL.

Outputs (``--output-dir``): ``positions.parquet`` (one row per document, position, policy,
window, seed), ``summary.csv`` (per policy, window and log2 position bucket),
``stepwise.parquet`` (the stepwise check, one row per checked position and cell),
``buckets.parquet`` (sums per document, cell and quarter octave of N: what the report's
means, intervals and incidences need when ``positions.parquet`` is too large to keep),
``state_error.parquet`` (with ``--state-error``: per-layer, per-head state error against the
reference and each head's mean decay, :mod:`.state_error`),
``manifest.json`` (command, versions, model and data identity, BOS choice, non-finite counts,
path noise, git commit, timings). Finished (document, cell) pieces are kept under ``parts/``;
a rerun with the same arguments skips them (resume); other settings are refused.

This module is the command line and the plan (argument checks, ``--dry-run``, the memory
estimate); the run itself -- lockstep loop, resume, tables, manifest -- is
:mod:`replayssm_quant.evals.kl.run`. Run ``replayssm-kl --help`` for the arguments;
docs/kl-runner.md has the decisions and numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from replayssm_quant.config import GDNFold
from replayssm_quant.outpaths import ancestor_problem, nearest_existing
from replayssm_quant.philox import SEED_LIMIT

from .documents import BOS_CHOICES, BadTokenizer, load_tokenization, make_documents
from .metrics import PERCENTILES, pair_kl, position_metrics, summarize  # noqa: F401 (re-exported)
from .memory import cache_bytes, check_budget_arg, device_budget, format_bytes, model_shape, plan_rank
from .run import (COLUMNS, IDENTITY_FILE, METRICS_VERSION, STEP_COLUMNS, BadArgs,  # noqa: F401
                  DamagedPart,
                  REFERENCE_WINDOW, _check_identity, _set_threads, cell_plan, pending_pairs, run,
                  run_cells, run_identity,
                  stepwise_summary)

EXIT_BAD_ARGS = 2
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
EXIT_TERMINATED = 143   # SIGTERM (128 + SIGTERM): kill, timeout, a batch system's pre-emption


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the signal arrives (by :func:`interrupt_on_sigterm`), so that
    the tools handle it as Ctrl-C: the finished cells stay on disk and the same command
    resumes; the exit code is :data:`EXIT_TERMINATED`."""


@contextlib.contextmanager
def interrupt_on_sigterm():
    """Inside the block, SIGTERM raises :class:`Terminated` (a KeyboardInterrupt) instead of
    ending the process at once; the earlier handler is restored on exit. Only in the main
    thread (Python delivers signals there); elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def interrupt_exit(e: KeyboardInterrupt) -> tuple[int, str]:
    """The exit code and the word for an interrupt: ``(143, "terminated (SIGTERM)")`` for
    :class:`Terminated`, ``(130, "interrupted")`` for Ctrl-C."""
    if isinstance(e, Terminated):
        return EXIT_TERMINATED, "terminated (SIGTERM)"
    return EXIT_INTERRUPTED, "interrupted"


DEFAULT_POLICIES = ("shared:nvfp4+sr", "read:nvfp4/rec:fp32", "read:nvfp4/rec:fp16+sr",
                    "eager:fp8e4m3")
DEFAULT_STEPWISE_CHECK = 64




# ------------------------------------------------------------------------------ arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="replayssm-kl",
        description="Teacher-forced per-position KL(P_fp32 || P_policy) of SSM state policies. "
        "With no --model/--dataset it runs the embedded tiny-gdn model on the embedded KJV "
        "held-out books, offline on CPU.")
    p.add_argument("--model", default="tiny-gdn",
                   help="embedded name (tiny-gdn, tiny-mamba2), local model directory or hub id "
                   "(default: tiny-gdn)")
    p.add_argument("--dataset", default=["kjv"],
                   help="'kjv' (embedded), 'pg19' (hub), or local .txt/.jsonl/.parquet files or "
                   "directories (several allowed, comma-free paths)", nargs="+")
    p.add_argument("--split", default=None, help="corpus split (kjv: heldout [default]; pg19: test)")
    p.add_argument("--max-docs", type=int, default=4, help="documents to evaluate (default 4)")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                   help="state policies, e.g. shared:nvfp4+sr read:nvfp4/rec:fp16+sr eager:fp8e4m3, "
                   "or policy maps (per layer / head / decay bucket): a JSON file map.json or a "
                   "compact 'map:DEFAULT@L3=P@L4H0-1=P@D0.99=P' string (docs/planner.md); "
                   f"default: {' '.join(DEFAULT_POLICIES)}")
    p.add_argument("--decay-stats", default=None, metavar="PATH",
                   help="per-head mean decays for the decay buckets of policy maps (JSON: "
                   "replayssm-attribute's decay.json or docs/models/<model>-stats.json; default: "
                   "the model directory's decay_stats.json, which the embedded models carry)")
    p.add_argument("--windows", nargs="+", type=int, default=[16], help="flush windows L (default 16)")
    p.add_argument("--max-tokens", "-N", type=int, default=1024, dest="max_tokens",
                   help="positions per document N (default 1024); documents shorter than N+1 "
                   "tokens are joined with the next ones")
    p.add_argument("--prefill", type=int, default=0,
                   help="prompt tokens run through the exact scan before emulation starts "
                   "(their positions are not reported; default 0)")
    p.add_argument("--segment-len", type=int, default=512, help="tokens per forward call (default 512)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="documents processed together (default 1); each document still runs "
                   "through the model alone, so results do not depend on it (docs/invariance.md)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="SR seeds (default 0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"),
                   help="model dtype (default float32)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU intra-op threads (default 0 = auto: 1 for models under 50 M parameters "
                   "or when the load average already exceeds the core count, else torch's default; "
                   "extra threads of many "
                   "small ops mostly wait on each other)")
    p.add_argument("--output-dir", "-o", default="kl-run", help="output directory (default ./kl-run)")
    p.add_argument("--dt-limit", default="decode", choices=("decode", "clamp"),
                   help="Mamba-2 time_step_limit rule on every call: 'decode' (default: no clamp, as "
                   "transformers' decode step and serving) or 'clamp' (as its chunked scan); "
                   "docs/adapters.md")
    p.add_argument("--gdn-fold", default="recompute", choices=[f.value for f in GDNFold],
                   help="GDN flush: re-solve corrections against A (default) or fold cached ones")
    p.add_argument("--add-bos-token", default="auto", choices=BOS_CHOICES,
                   help="BOS at the start of each document, as lm-eval's HFLM add_bos_token: auto "
                   "(default) = the tokenizer's own default (add_special_tokens=True), true = "
                   "always, false = never (add_special_tokens=False)")
    p.add_argument("--stepwise-check", type=int, default=None, metavar="K", dest="stepwise_check",
                   help="also decode the first K reported positions of every cell token by token "
                   "(one forward call per token with the cache) and report KL(stepping || "
                   f"emulation), the float32 path noise of emulation (default min({DEFAULT_STEPWISE_CHECK}, "
                   "N - prefill); 0 = off)")
    p.add_argument("--state-error", action="store_true", dest="state_error",
                   help="also record, at the first segment end of each octave of N (and at N "
                   "when it ends a window; --segment-len must be a multiple of every window), "
                   "each SSM layer's and "
                   "head's relative state error (read copy and recurrence anchor against the fp32 "
                   "reference state) and the head's mean decay: state_error.parquet")
    p.add_argument("--device-map", default=None, choices=("auto",), dest="device_map",
                   help="'auto': shard one model over the rank's GPUs with accelerate (as "
                   "from_pretrained(device_map='auto')); under torchrun the node's GPUs are split "
                   "among its ranks (4 GPUs, 2 ranks: 2 GPUs each); on CPU everything stays on the "
                   "CPU. Default: the whole model on --device (docs/distributed.md)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GIB", dest="memory_budget",
                   help="memory per device and rank to plan with, in GiB (default: the free memory "
                   "of each GPU; on CPU the available memory divided among the node's ranks); a "
                   "plan that does not fit is refused before any compute (exit 2)")
    p.add_argument("--cells-per-pass", type=int, default=0, metavar="G", dest="cells_per_pass",
                   help="run a document's cells in passes of G cells, each pass with its own "
                   "reference pass (G + 1 caches live instead of one per cell + 1; costs one "
                   "reference forward per extra pass; results do not change). Default 0 = all "
                   "cells of a document in one pass")
    p.add_argument("--max-cells", type=int, default=None, metavar="M", dest="max_cells",
                   help="compute at most M of the missing (document, policy, window, seed) cells in "
                   "this invocation (all ranks together), then stop; rerun to continue (for "
                   "time-limited jobs). Tables are written once every cell is done")
    p.add_argument("--dist-timeout", type=float, default=1440.0, metavar="MIN", dest="dist_timeout",
                   help="timeout of the process group's collectives in minutes (default 1440); "
                   "rank 0 waits this long at the end for the slowest rank")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (cells per rank) and the memory plan per rank, then exit; "
                   "exit 2 if a rank's plan does not fit its devices")
    p.add_argument("--no-progress", action="store_true",
                   help="disable progress bars (they are off anyway where stderr is not a "
                        "terminal)")
    # replayssm-plan / replayssm-attribute run cell sets of their own into one folder: the
    # note on other cells' parts would only repeat itself there
    p.add_argument("--no-other-cells-note", action="store_true", help=argparse.SUPPRESS)
    return p


def check_device(device: str) -> None:
    """``--device`` as the runners take it: ``cpu``, ``cuda`` or ``cuda:I``, with CUDA
    available and device I present.

    Raises:
        BadArgs: naming the value and what is expected.
    """
    if device == "cuda" or device.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            raise BadArgs(f"--device {device}: CUDA is not available")
        idx = device[len("cuda:"):]
        if device != "cuda" and (not idx.isdigit() or int(idx) >= torch.cuda.device_count()):
            raise BadArgs(f"--device must be cpu, cuda or cuda:I with I < "
                          f"{torch.cuda.device_count()}, got {device!r}")
    elif device != "cpu":
        raise BadArgs(f"--device must be cpu, cuda or cuda:I, got {device!r}")


def check_output_dir(path, flag: str = "--output-dir") -> None:
    """Refuse an output directory that cannot hold a run, before anything loads: a path that
    exists and is not a writable directory, or one that cannot be created (a file or an
    unwritable directory on the way, or a file system that refuses it). Creates nothing: a
    missing directory is made and removed again, with the missing parents between.

    Raises:
        BadArgs: naming ``flag``, the path and the reason; also for an empty path (an unset
            shell variable in ``-o "$OUT"``), which would otherwise write into the current
            directory (``.`` says that on purpose).
    """
    if not str(path).strip():
        raise BadArgs(f"{flag} is empty ({str(path)!r}); give a directory, or '.' for the "
                      "current one")
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise BadArgs(f"{flag} {str(path)!r} exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise BadArgs(f"{flag} {str(path)!r} is not writable")
        return
    parent, missing = nearest_existing(p)
    reason = ancestor_problem(parent)
    if reason:
        raise BadArgs(f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is {reason}")
    try:  # exist_ok: ranks under a launcher may probe the same path at once
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadArgs(f"{flag} {str(path)!r} cannot be created: {e.strerror or e}") from None
    finally:
        for d in missing:  # deepest first; only empty directories go (never a run's)
            with contextlib.suppress(OSError):
                d.rmdir()


def check_backend_env(device: str | None = None) -> None:
    """BadArgs for a ``REPLAYSSM_BACKEND`` (or a deprecated per-family variable) that names no
    backend, or (with ``device``, the run's ``--device``) one that cannot run there (``cuda``
    off a GPU, ``triton`` on CPU without ``TRITON_INTERPRET=1``), before any work
    (:func:`replayssm_quant.backend.check_setting`): otherwise the first operation that reads
    it fails mid-run, after the output directory has been written to."""
    from replayssm_quant.backend import check_setting

    try:
        check_setting(device)
    except ValueError as e:
        raise BadArgs(str(e)) from None


def _check_args(a) -> list:
    """Validate everything that needs no model weights; returns parsed policies (StatePolicy
    or PolicyMap)."""
    from replayssm_quant.policymap import load_decay_stats, parse_state_arg

    if a.max_tokens <= 0:
        raise BadArgs(f"--max-tokens must be > 0, got {a.max_tokens}")
    if a.prefill < 0 or a.prefill >= a.max_tokens:
        raise BadArgs(f"--prefill must be in [0, max-tokens) = [0, {a.max_tokens}), got {a.prefill}")
    if a.threads < 0:
        raise BadArgs(f"--threads must be >= 0, got {a.threads}")
    if a.threads > (os.cpu_count() or 1):
        print(f"replayssm-kl: note: --threads {a.threads} is more than the {os.cpu_count()} "
              "CPU(s) here; oversubscribed intra-op threads slow the run (0 chooses)",
              file=sys.stderr)
    check_output_dir(a.output_dir)
    for name in ("segment_len", "batch_size", "max_docs"):
        if getattr(a, name) <= 0:
            raise BadArgs(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if any(w < 1 for w in a.windows):
        raise BadArgs(f"--windows must be >= 1, got {a.windows}")
    if any(not 0 <= s < SEED_LIMIT for s in a.seeds):
        raise BadArgs(f"--seeds must be ints in [0, 2^63) (SR's Philox key), got {a.seeds}")
    for flag, vals in (("--windows", a.windows), ("--seeds", a.seeds)):
        rep = sorted({v for v in vals if vals.count(v) > 1})
        if rep:
            raise BadArgs(f"{flag} repeats {', '.join(map(str, rep))} (got {' '.join(map(str, vals))}); "
                          "give each value once: every (policy, window, seed) cell must be unique")
    if getattr(a, "state_error", False):
        bad = [w for w in a.windows if a.segment_len % w]
        if bad:
            raise BadArgs(f"--state-error compares states where both sit on a flush, at segment "
                          f"ends: --segment-len must be a multiple of every window, and "
                          f"{a.segment_len} is not a multiple of --windows "
                          f"{' '.join(map(str, bad))}")
    if a.stepwise_check is None:
        a.stepwise_check = min(DEFAULT_STEPWISE_CHECK, a.max_tokens - a.prefill)
    elif not 0 <= a.stepwise_check <= a.max_tokens - a.prefill:
        raise BadArgs(f"--stepwise-check must be in [0, max-tokens - prefill] = "
                      f"[0, {a.max_tokens - a.prefill}], got {a.stepwise_check}")
    pols = []
    for s in a.policies:
        try:
            pols.append(parse_state_arg(s))
        except ValueError as e:
            raise BadArgs(str(e)) from None
    if a.decay_stats is not None:
        try:
            load_decay_stats(a.decay_stats)
        except ValueError as e:
            raise BadArgs(f"--decay-stats: {e}") from None
    same = {}
    for s, p in zip(a.policies, pols):
        same.setdefault(str(p), []).append(s)
    dup = {k: v for k, v in same.items() if len(v) > 1}
    if dup:
        desc = "; ".join(" and ".join(repr(x) for x in v) + f" are both the policy {k!r}"
                         for k, v in dup.items())
        raise BadArgs(f"duplicate policies: {desc}; give each policy once")
    check_device(a.device)
    check_backend_env(a.device)  # names a backend, and one that runs on the device
    if a.device_map and a.device.startswith("cuda:"):
        raise BadArgs(f"--device-map auto places the model on the rank's GPUs itself; give "
                      f"--device cuda, not {a.device}")
    if a.cells_per_pass < 0:
        raise BadArgs(f"--cells-per-pass must be >= 0 (0 = all cells in one pass), got {a.cells_per_pass}")
    if a.max_cells is not None and a.max_cells <= 0:
        raise BadArgs(f"--max-cells must be > 0, got {a.max_cells}")
    if not a.dist_timeout > 0:
        raise BadArgs(f"--dist-timeout must be > 0 minutes, got {a.dist_timeout}")
    check_budget_arg(a.memory_budget)
    idle = [w for w in a.windows if w >= a.max_tokens] if a.prefill == 0 else []
    if idle:  # every output then reads the cast of the zero initial state plus the buffer
        print(f"replayssm-kl: warning: --windows {' '.join(map(str, idle))} >= --max-tokens "
              f"{a.max_tokens} without --prefill: no flush happens within a document, so in "
              f"those cells only eager: policies (rounded every token) differ from FP32 state",
              file=sys.stderr)
        big = [w for w in idle if w > 4 * a.max_tokens]
        if big:  # the window forms pad their records to L for their bits (replay/window.py)
            print(f"replayssm-kl: warning: --windows {' '.join(map(str, big))} > 4 x --max-tokens: "
                  f"the window forms pad each call's records to L for their bits, so these "
                  f"cells' state path costs more than with a window of {a.max_tokens} (about "
                  f"L / {a.max_tokens} times; GDN's correction solve up to (L / "
                  f"{a.max_tokens})^2), which computes the same no-flush outputs (up to last "
                  f"bits)", file=sys.stderr)
    return pols


def _load_config(model: str):
    from transformers import AutoConfig

    from replayssm_quant.adapters import SUPPORTED_ARCHITECTURES
    from replayssm_quant.models import is_embedded, resolve_model_path

    try:
        path = resolve_model_path(model)
    except (ValueError, FileNotFoundError, TypeError) as e:  # not a model name, path or hub id
        raise BadArgs(f"cannot load model config {model!r}: {e}") from None
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=is_embedded(model) or os.path.isdir(path))
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --model
        hint = ("" if is_embedded(model) or os.path.exists(model) or
                os.environ.get("HF_HUB_OFFLINE") == "1" else
                " (a hub id; on a machine without the hub, HF_HUB_OFFLINE=1 makes this fail at "
                "once instead of after the hub client's retries)")
        raise BadArgs(f"cannot load model config {model!r}: {e}{hint}") from None
    mt = getattr(cfg, "model_type", "")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    arch = getattr(text, "model_type", mt)
    arch = arch[:-5] if arch.endswith("_text") else arch
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BadArgs(f"model {model!r} has architecture {arch!r}, which has no SSM layers this "
                      f"runner supports; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return path, cfg, arch


def _check_weights(path: str) -> None:
    """Refuse a model directory without weights (transformers' file names: one file, or an
    index of shards), or whose safetensors files do not open (their headers only are read),
    before any compute: :class:`BadArgs` naming the file."""
    from transformers.utils import (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
                                    WEIGHTS_INDEX_NAME, WEIGHTS_NAME)

    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    if not any(os.path.isfile(os.path.join(path, f)) for f in names):
        raise BadArgs(f"model directory {path!r} has a config but no weights (expected one of "
                      f"{', '.join(names)})")
    from safetensors import safe_open

    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, f), "pt"):
                    pass
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file
                raise BadArgs(f"model weights {os.path.join(path, f)!r} do not open: "
                              f"{type(e).__name__}: {e}") from None


def _check_maps(a, policies, cfg, cfg_path) -> None:
    """Resolve every policy map against the model's SSM layers (a weightless copy of the
    model), so that a map naming a missing layer or head, or decay buckets without decays,
    exits 2 before any compute."""
    from .maps import resolve_maps

    try:
        resolve_maps(policies, cfg, cfg_path, a.decay_stats)
    except ValueError as e:
        raise BadArgs(str(e)) from None


def _load_docs(a):
    from replayssm_quant.data import load_corpus

    docs = []
    for ds in a.dataset:
        try:
            split = a.split if ds.lower() in ("kjv", "pg19") else None
            docs.extend(load_corpus(ds, split=split))
        except Exception as e:  # noqa: BLE001
            raise BadArgs(f"cannot read dataset {ds!r}: {e}") from None
    docs = [d for d in docs if d.get("text")]
    if not docs:
        raise BadArgs(f"dataset {a.dataset} has no non-empty documents")
    return docs


# ------------------------------------------------------------------------------ plan
def memory_estimate(cfg, a, n_cells: int) -> dict:
    """Rough peak bytes of a single-process run whose every document needs all ``n_cells``
    cells (kept for callers of the old estimate; the runner plans per rank with
    :func:`plan_ranks`)."""
    from replayssm_quant.config import StateConfig

    from .maps import cell_config

    shape = model_shape(cfg, a.dtype)
    ref = StateConfig.build("fp32", window=REFERENCE_WINDOW, seed=0, fold=a.gdn_fold)
    configs = [cell_config(p, w, s, a.gdn_fold)
               for p in a.policies for w in a.windows for s in a.seeds][:n_cells]
    pairs = [(d, c) for d in range(a.batch_size) for c in range(len(configs))]
    plan = plan_rank(0, shape, a, pairs, configs, ref, ["cpu"], {"cpu": 1 << 62})
    return {"params": shape.params, "weights_bytes": shape.weights_bytes,
            "state_bytes_per_cache": cache_bytes(shape, ref, a.max_tokens)["state"],
            "kv_bytes_per_cache": cache_bytes(shape, ref, a.max_tokens)["kv"],
            "caches": plan.live_caches, "logits_bytes": plan.logits,
            "total_bytes": plan.total("cpu")}


def rank_devices(a, ranks, rank: int | None = None) -> tuple[list, list | None]:
    """Devices of rank ``rank`` (default: this process's): ``(devices, device-map GPUs)``.
    CPU: ``["cpu"]``; CUDA: ``["cuda:LOCAL_RANK"]``, or with ``--device-map auto`` the rank's
    group of the node's GPUs (:func:`~replayssm_quant.evals.kl.dist.gpu_group`)."""
    from . import dist

    if rank is not None:  # planning for another rank of the same (homogeneous) launch
        ranks = dist.Ranks(rank, ranks.world_size, rank % ranks.local_world_size,
                           ranks.local_world_size, ranks.launched)
    if not a.device.startswith("cuda"):
        return ["cpu"], None
    import torch

    n = torch.cuda.device_count()
    if a.device_map:
        gpus = dist.gpu_group(ranks.local_rank, ranks.local_world_size, n)
        return [f"cuda:{i}" for i in gpus], gpus
    dev = dist.rank_device(a.device, ranks, n)
    return [dev if ":" in dev else "cuda:0"], None


def plan_ranks(a, shape, cells, todo: list, ranks, which=None) -> list:
    """The memory plan of every rank (``which``: only these ranks) for the pairs ``todo``."""
    from replayssm_quant.config import StateConfig

    from . import dist
    from .maps import cell_config

    ref = StateConfig.build("fp32", window=REFERENCE_WINDOW, seed=0, fold=a.gdn_fold)
    configs = [cell_config(p, w, s, a.gdn_fold) for p, w, s in cells]
    shards = dist.shard(todo, ranks.world_size)
    plans = []
    for r in (range(ranks.world_size) if which is None else which):
        devices, gpus = rank_devices(a, ranks, r)
        budget = {d: device_budget(d, ranks.local_world_size, a.memory_budget) for d in devices}
        plans.append(plan_rank(r, shape, a, shards[r], configs, ref, devices, budget, gpus))
    return plans


def print_plan(a, arch, shape, tokz, token_docs, policies, cells, ucells, todo, ranks, plans) -> None:
    """The ``--dry-run`` report: run, cells, resume state, per-rank shares and memory."""
    from replayssm_quant.config import StateConfig

    from .maps import cell_config

    bos = tokz.manifest()
    n_pairs = len(ucells) * len(token_docs)
    print(f"plan: model {a.model} ({arch}, {shape.params:,} parameters, {a.dtype}, {a.device}"
          f"{', device map auto' if a.device_map else ''})")
    print(f"      {len(token_docs)} documents x N={a.max_tokens} tokens (prefill {a.prefill}), "
          f"segments of {min(a.segment_len, a.max_tokens)}, batch {a.batch_size}, tokenizer {tokz.name}, "
          f"BOS {a.add_bos_token} ({bos['documents_starting_with_bos']} of "
          f"{bos['documents']} documents start with BOS)")
    print(f"      {len(cells)} cell{'' if len(cells) == 1 else 's'} = policies "
          f"{[str(p) for p in policies]} x windows {a.windows} "
          f"x seeds {a.seeds} ({len(ucells)} computed: eager: cells run with L = 1, cells "
          f"without SR ignore the seed); reference fp32 (L = {REFERENCE_WINDOW}) computed once "
          f"per document and rank; stepwise check of the first {a.stepwise_check} positions")
    print(f"      {n_pairs - len(todo)} of {n_pairs} (document, cell) pairs already done in "
          f"{a.output_dir} (resume); {len(todo)} to compute"
          + (f", at most {a.max_cells} in this invocation (--max-cells)" if a.max_cells else ""))
    print(f"      world size {ranks.world_size} ({ranks.local_world_size} per node): contiguous "
          "document-major blocks of the pairs to compute")
    print(f"      output -> {a.output_dir}")
    print(f"memory per cache of one document (N={a.max_tokens}):")
    ref = StateConfig.build("fp32", window=REFERENCE_WINDOW, seed=0, fold=a.gdn_fold)
    seen = set()
    confs = [(p, cell_config(p, w, 0, a.gdn_fold)) for p, w, _ in ucells]
    for name, conf in [("reference fp32", ref)] + [(f"{p} L={c.window}", c) for p, c in confs]:
        if name in seen:
            continue
        seen.add(name)
        cb = cache_bytes(shape, conf, a.max_tokens)
        print(f"      {name:32s} state {format_bytes(cb['state'])} + window buffer "
              f"{format_bytes(cb['records'])} + conv {format_bytes(cb['conv'])} + KV "
              f"{format_bytes(cb['kv'])} = {format_bytes(cb['total'])}")
    print("memory estimate per rank (budget: free device memory, or --memory-budget):")
    for p in plans:
        devs = ",".join(p.devices)
        print(f"  rank {p.rank}: {devs}: {p.pairs} pairs over {p.documents} document(s), "
              f"{p.live_caches} caches live at once ({p.live_cells} cells + references)")
        for d in p.devices:
            w = p.weights.get(d, 0)
            ok = p.total(d) <= p.budget[d] and not p.problem
            print(f"      {d}: weights {format_bytes(w)} + caches "
                  f"{format_bytes(p.caches // len(p.devices))} + logits {format_bytes(p.logits)} "
                  f"+ activations {format_bytes(p.activations)} + overhead "
                  f"{format_bytes(p.overhead)} = {format_bytes(p.total(d))} of "
                  f"{format_bytes(p.budget[d])}: {'fits' if ok else 'DOES NOT FIT'}")
        if p.problem:
            print(f"      {p.problem}")


def passes_that_fit(a, shape, cells, todo, ranks, which=None) -> int | None:
    """The largest ``--cells-per-pass`` below the current one with which every planned rank
    fits (None if none does): the plan's suggestion when it refuses."""
    import copy

    current = a.cells_per_pass or len(cells)
    lo, hi, best = 1, current - 1, None
    while lo <= hi:  # fewer cells per pass never needs more memory: bisect
        mid = (lo + hi) // 2
        b = copy.copy(a)
        b.cells_per_pass = mid
        if all(p.fits for p in plan_ranks(b, shape, cells, todo, ranks, which)):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def refusal(plans, passes=None) -> str:
    """The exit-2 message of a plan some rank cannot hold ('' if every rank fits); ``passes``:
    a ``--cells-per-pass`` value that would fit, if any."""
    bad = [p for p in plans if not p.fits]
    if not bad:
        return ""
    more = f" (and {len(bad) - 1} more of the {len(plans)} ranks)" if len(bad) > 1 else ""
    hint = f"--cells-per-pass {passes} (fits), " if passes else ""
    return ("the plan does not fit: " + bad[0].why() + more
            + f". Use {hint}more ranks (each then holds fewer cells), --device-map auto over more GPUs, "
            "a smaller --batch-size or --segment-len, smaller --windows (each window is padded "
            "to L, so its activations grow as L squared), fewer --stepwise-check positions, or "
            "fewer policies/windows/seeds per run (see --dry-run; --memory-budget overrides the "
            "detected budget)")


def check_found_documents(token_docs, a, n_flag: str = "--max-tokens") -> None:
    """Refuse a dataset that holds no document of N + 1 tokens (``a.max_tokens`` = N;
    ``n_flag``: the calling command's name for N, as the user typed it)."""
    if not token_docs:
        raise BadArgs(f"dataset {a.dataset} has fewer than {a.max_tokens} tokens in all; "
                      f"lower {n_flag}")


def _check_documents(token_docs) -> None:
    """Refuse repeated documents (same id, or same tokens): their rows would collide."""
    seen_id, seen_sha = {}, {}
    for d in token_docs:
        if d["id"] in seen_id:
            raise BadArgs(f"document id {d['id']!r} occurs twice in --dataset; give each "
                          "document once (or give them distinct ids)")
        if d["sha"] in seen_sha:
            raise BadArgs(f"documents {seen_sha[d['sha']]!r} and {d['id']!r} have the same tokens; "
                          "give each document once")
        seen_id[d["id"]] = seen_sha[d["sha"]] = d["id"]


def run_fingerprint(a, cfg, ucells, token_docs) -> dict:
    """What every rank of one run must agree on: the settings that change its numbers
    (:func:`~replayssm_quant.evals.kl.run.run_identity`), the computed cells, the documents
    (ids and token hashes), and the stepwise and state-error checks. (The output folder is
    checked by a probe file, :func:`_check_shared_output`: ranks on other nodes may mount it
    at another path.)"""
    return {**run_identity(a, cfg), "cells": [str(c) for c in ucells],
            "documents": [(d["id"], d["sha"]) for d in token_docs],
            "stepwise_check": a.stepwise_check, "state_error": bool(a.state_error)}


def _check_same_run(a, cfg, ucells, token_docs, group) -> None:
    """Refuse (every rank together, before any work is shared out) ranks started with
    different arguments or data: rank 0 hands out ``(document, cell)`` indices that each rank
    looks up in its own lists, so a rank with another ``--dtype``, ``--gdn-fold``, policy list,
    seed list or corpus would otherwise compute other cells into the same tables. A resumed
    run is also caught by each rank's ``run_identity.json`` check; a new folder only here.

    Raises:
        BadArgs: naming the first rank that differs from rank 0 and the settings that differ.
    """
    def show(v):
        t = repr(v)
        return t if len(t) <= 80 else t[:77] + "..."

    prints = group.all_gather(run_fingerprint(a, cfg, ucells, token_docs))
    for r, fp in enumerate(prints[1:], 1):
        diff = [k for k in prints[0] if fp.get(k) != prints[0][k]]
        if diff:
            desc = "; ".join(f"{k}: {show(prints[0][k])} on rank 0, {show(fp.get(k))} on rank {r}"
                             for k in diff)
            raise BadArgs(f"the ranks were started with different arguments or data ({desc}); "
                          "start every rank with the same command and --dataset")


def _check_shared_output(a, cfg, group) -> None:
    """Every rank must see the same ``--output-dir`` (rank 0 merges the ranks' part files):
    rank 0 writes a probe file there, every rank looks for it."""
    import uuid

    from .run import write_identity

    out = Path(a.output_dir)
    name = group.broadcast(f".rank0-probe-{uuid.uuid4().hex}" if group.rank == 0 else None)
    if group.rank == 0:
        write_identity(a, cfg)
        (out / "parts" / name).write_text("")
    group.all_gather(None)  # the probe exists before anyone looks
    seen = group.all_gather((out / "parts" / name).exists())
    group.all_gather(None)
    if group.rank == 0:
        (out / "parts" / name).unlink(missing_ok=True)
    if not all(seen):
        blind = [r for r, ok in enumerate(seen) if not ok]
        raise BadArgs(f"--output-dir {a.output_dir!r} is not shared: ranks {blind} do not see the "
                      "files rank 0 writes there; put it on a filesystem every node mounts "
                      "(each rank writes its part files there and rank 0 merges them)")


def _plan_record(p) -> dict:
    """A rank's memory plan as the manifest records it (bytes)."""
    return {"rank": p.rank, "devices": p.devices, "pairs": p.pairs, "documents": p.documents,
            "live_caches": p.live_caches, "weights": p.weights, "caches": p.caches,
            "logits": p.logits, "activations": p.activations, "overhead": p.overhead,
            "total": {d: p.total(d) for d in p.devices}, "budget": p.budget}


def main(argv=None) -> int:
    """``replayssm-kl``: check the arguments and the plan, then run this process's share of the
    cells (a plain run, or one rank under torchrun / accelerate launch). Returns the exit
    code: 0, 2 for bad input or a plan that does not fit (before any compute), 130 when
    interrupted (Ctrl-C), 143 when terminated (SIGTERM); either way the finished cells are
    kept and the same command resumes."""
    with interrupt_on_sigterm():
        return _main(argv)


def _main(argv=None) -> int:
    from . import dist

    parser = build_parser()
    a = parser.parse_args(argv)
    ranks = group = None
    try:
        policies = _check_args(a)
        ranks = dist.ranks_from_env(planning=a.dry_run)
        cfg_path, cfg, arch = _load_config(a.model)
        if os.path.isdir(cfg_path):
            try:
                _check_weights(cfg_path)
            except BadArgs as e:  # a dry run plans from the config alone
                if not a.dry_run:
                    raise
                print(f"replayssm-kl: note: {e}: a run would refuse it", file=sys.stderr)
        _check_maps(a, policies, cfg, cfg_path)
        docs = _load_docs(a)
        vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size
        try:
            tokz = load_tokenization(cfg_path, vocab, a.add_bos_token)
        except BadTokenizer as e:
            raise BadArgs(str(e)) from None
        if tokz.fallback:
            print(f"replayssm-kl: note: {tokz.fallback}", file=sys.stderr)
        token_docs = make_documents(docs, tokz, a.max_tokens + 1, a.max_docs)
        _check_identity(a, cfg)
        check_found_documents(token_docs, a)
        if len(token_docs) < a.max_docs:
            print(f"replayssm-kl: note: --max-docs {a.max_docs}, but the dataset holds "
                  f"{len(token_docs)} document(s) of {a.max_tokens + 1} tokens: running "
                  f"{len(token_docs)}", file=sys.stderr)
        _check_documents(token_docs)
        cells, _canon, ucells, _configs = cell_plan(policies, a)  # ucells: the units of work
        try:
            shape = model_shape(cfg, a.dtype)
        except Exception as e:  # noqa: BLE001 - a config the meta model cannot be built from
            # no plan (the run itself may still work: loading is from_pretrained's business)
            if a.device_map and a.device.startswith("cuda"):
                raise BadArgs(f"--device-map auto needs the memory plan, but model {a.model!r} "
                              f"cannot be built from its config on the meta device: {e}") from None
            if ranks.rank == 0:
                print(f"replayssm-kl: warning: no memory plan (model {a.model!r} cannot be built "
                      f"from its config on the meta device: {e})", file=sys.stderr)
            shape = None
        out = Path(a.output_dir)
        if a.dry_run:
            if ranks.rank != 0:  # under a launcher: rank 0 plans for every rank
                return 0
            todo = pending_pairs(out, token_docs, ucells, a.stepwise_check, a.state_error)
            todo = todo[:a.max_cells] if a.max_cells else todo
            if shape is None:
                print(f"plan: {len(todo)} (document, cell) pairs to compute over "
                      f"{ranks.world_size} rank(s); no memory plan (see the warning)")
                return 0
            plans = plan_ranks(a, shape, ucells, todo, ranks)
            print_plan(a, arch, shape, tokz, token_docs, policies, cells, ucells, todo, ranks, plans)
            fits = all(p.fits for p in plans)
            msg = refusal(plans, None if fits else passes_that_fit(a, shape, ucells, todo, ranks))
            if msg:
                raise BadArgs(msg)
            return 0
        devices, gpus = rank_devices(a, ranks)
        group = dist.start_group(ranks, devices[0], a.dist_timeout)
        if ranks.world_size > 1:
            _check_same_run(a, cfg, ucells, token_docs, group)
        todo = group.broadcast(pending_pairs(out, token_docs, ucells, a.stepwise_check, a.state_error)
                               if ranks.rank == 0 else None)
        missing = len(todo)
        total = len(token_docs) * len(ucells)
        if ranks.rank == 0 and 0 < missing < total:  # a resume: say what is reused
            print(f"replayssm-kl: resuming: {total - missing} of {total} (document, cell) "
                  f"pairs are already done in {a.output_dir}; computing the other {missing}",
                  file=sys.stderr)
        todo = todo[:a.max_cells] if a.max_cells else todo
        mine, plans = None, []
        if shape is not None:
            mine = plan_ranks(a, shape, ucells, todo, ranks, which=[ranks.rank])[0]
            fit = mine.fits or passes_that_fit(a, shape, ucells, todo, ranks, which=[ranks.rank])
            # every rank refuses together, before any weight loads
            plans, fits = zip(*group.all_gather((mine, fit)))
            # a --cells-per-pass that every rank fits with (True: the rank fits as it is)
            needed = [f for f in fits if f is not True]
            passes = min(needed) if needed and None not in needed else None
            msg = refusal(plans, passes)
            if msg:
                raise BadArgs(msg)
        if ranks.world_size > 1:
            _check_shared_output(a, cfg, group)
    except BadArgs as e:
        # before the group exists every rank reports (ranks may differ, e.g. a missing GPU);
        # after it, the decision is common and rank 0 reports it
        if group is None or not group.active or group.rank == 0:
            who = (f"rank {ranks.rank}: " if ranks is not None and ranks.world_size > 1
                   and group is None and not a.dry_run else "")
            print(f"replayssm-kl: error: {who}{e}", file=sys.stderr)
        if group is not None:
            group.close()
        return EXIT_BAD_ARGS
    except KeyboardInterrupt as e:
        code, what = interrupt_exit(e)
        print(f"\nreplayssm-kl: {what} before any cell of this invocation ran",
              file=sys.stderr)
        if group is not None:
            group.close()
        return code
    try:
        work = dist.shard(todo, ranks.world_size)[ranks.rank]
        return run(a, policies, cfg_path, cfg, arch, token_docs, tokz, work=work, group=group,
                   device=devices[0], device_map=mine.device_map if mine else None,
                   params=shape.params if shape else None,
                   left=missing - len(todo), plans=[_plan_record(p) for p in plans])
    except DamagedPart as e:
        print(f"replayssm-kl: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except KeyboardInterrupt as e:
        code, what = interrupt_exit(e)
        done = len(list((Path(a.output_dir) / "parts").glob("*.parquet")))
        print(f"\nreplayssm-kl: {what}; {done} finished cells are saved in "
              f"{a.output_dir}/parts; run the same command again to resume", file=sys.stderr)
        return code
    finally:
        group.close()


if __name__ == "__main__":
    sys.exit(main())
