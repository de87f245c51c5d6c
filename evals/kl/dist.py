"""``replayssm-kl`` on several processes: ranks from the launcher, the process group, the
sharding of (document, policy, window, seed) cells, and the GPUs of each rank
(docs/distributed.md).

The runner is launched by ``torchrun`` (``python -m torch.distributed.run``) or
``accelerate launch``, which start one process per rank and set ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
(:func:`ranks_from_env`). Nothing here schedules work dynamically:

* rank 0 lists the cells whose part files are missing (resume) and broadcasts the list;
* every rank takes one contiguous block of it (:func:`shard`), in document-major order, so a
  rank computes the FP32 reference of only the documents it has cells of (at most
  ``world_size - 1`` references are computed twice in a whole run);
* every rank writes each finished cell to its own part file; rank 0 gathers the ranks'
  statistics once at the end (which waits for the slowest rank) and merges the parts into the
  usual tables.

A process group (:class:`Group`) carries only small Python objects: the cell list, the memory
plan check and the statistics. On CPU it is ``gloo``; on CUDA ``cpu:gloo,cuda:nccl`` (NCCL for
CUDA tensors -- checked once at start with a one-element all-reduce on the rank's GPU -- and
gloo for the objects), with the timeout of ``--dist-timeout``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from .run import BadArgs

__all__ = ["Ranks", "ranks_from_env", "shard", "gpu_group", "rank_device", "Group", "start_group",
           "LAUNCH_VARS"]

#: Process counts set by MPI launchers (mpirun, accelerate launch's CPU mode): not supported.
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
#: The environment a launcher sets for every rank (torchrun, accelerate launch).
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the launched ones.

    Attributes:
        rank, world_size: global rank and number of processes.
        local_rank, local_world_size: the same on this node (GPUs are split by these).
        launched: started by a launcher (``MASTER_ADDR``/``MASTER_PORT`` set): a process group
            is formed even for ``world_size == 1`` (so ``torchrun --nproc-per-node 1`` runs
            exactly the code of a larger run).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False


def _env_int(env, name: str, default=None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise BadArgs(f"environment variable {name} is not set but WORLD_SIZE is "
                          f"({env.get('WORLD_SIZE')!r}); launch with torchrun or accelerate "
                          "launch, which set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE")
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadArgs(f"environment variable {name}={raw!r} is not an integer "
                      "(torchrun / accelerate launch set it to one)") from None


def ranks_from_env(env=None, *, planning: bool = False) -> Ranks:
    """The launcher's ranks (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).

    Without ``WORLD_SIZE`` this is a plain single-process run. ``LOCAL_WORLD_SIZE`` defaults to
    ``WORLD_SIZE`` (one node) and ``LOCAL_RANK`` to ``RANK``.

    Args:
        env: the environment (default ``os.environ``).
        planning: ``--dry-run``: ``RANK`` may be missing (planning for ``WORLD_SIZE`` ranks
            from one process) and no rendezvous address is needed.
    Raises:
        BadArgs: a variable that is not an integer, or ranks outside their ranges, or a
            multi-process launch without ``MASTER_ADDR``/``MASTER_PORT``.
    """
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE") in (None, ""):
        for name in MPI_SIZE_VARS:
            if env.get(name, "1").strip() not in ("", "0", "1"):
                raise BadArgs(f"started by MPI ({name}={env[name]}) without WORLD_SIZE/RANK: "
                              "every process would compute every cell; launch with torchrun "
                              "(or accelerate launch --multi_gpu), which set RANK and WORLD_SIZE")
        return Ranks()
    world = _env_int(env, "WORLD_SIZE")
    if world < 1:
        raise BadArgs(f"environment variable WORLD_SIZE={world} must be >= 1")
    rank = _env_int(env, "RANK", 0 if planning else None)
    local_world = _env_int(env, "LOCAL_WORLD_SIZE", world)
    local_rank = _env_int(env, "LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise BadArgs(f"environment variable RANK={rank} must be in [0, WORLD_SIZE) = [0, {world})")
    if not 1 <= local_world <= world:
        raise BadArgs(f"environment variable LOCAL_WORLD_SIZE={local_world} must be in "
                      f"[1, WORLD_SIZE] = [1, {world}]")
    if not 0 <= local_rank < local_world:
        raise BadArgs(f"environment variable LOCAL_RANK={local_rank} must be in "
                      f"[0, LOCAL_WORLD_SIZE) = [0, {local_world})")
    launched = bool(env.get("MASTER_ADDR")) and bool(env.get("MASTER_PORT"))
    if world > 1 and not launched and not planning:
        raise BadArgs(f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set; start the "
                      "ranks with torchrun or accelerate launch (docs/distributed.md)")
    return Ranks(rank, world, local_rank, local_world, launched and not planning)


def shard(pairs: list, world_size: int) -> list[list]:
    """Split ``pairs`` (the cells to compute, document-major) into ``world_size`` contiguous
    blocks whose sizes differ by at most one; block r is rank r's work.

    Contiguous blocks keep a document's cells together, so each rank computes the reference of
    few documents; the split depends only on the list and the world size (deterministic).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = len(pairs)
    return [list(pairs[r * n // world_size:(r + 1) * n // world_size]) for r in range(world_size)]


def gpu_group(local_rank: int, local_world_size: int, n_gpus: int) -> list[int]:
    """The GPU indices of one rank when ``--device-map auto`` shards its model: the node's
    ``n_gpus`` visible GPUs split into ``local_world_size`` equal groups (4 GPUs, 2 ranks per
    node: rank 0 gets GPUs 0 and 1, rank 1 GPUs 2 and 3); GPUs beyond the last full group stay
    unused.

    Raises:
        BadArgs: fewer GPUs than local ranks.
    """
    if n_gpus < local_world_size:
        raise BadArgs(f"--device-map auto with {local_world_size} ranks on this node needs at "
                      f"least {local_world_size} visible GPUs (one per rank), found {n_gpus}")
    g = n_gpus // local_world_size
    return list(range(local_rank * g, (local_rank + 1) * g))


def rank_device(device: str, ranks: Ranks, n_gpus: int) -> str:
    """The torch device of one rank without ``--device-map``: ``--device cuda`` becomes
    ``cuda:LOCAL_RANK`` under a launcher; CPU stays CPU.

    Raises:
        BadArgs: ``--device cuda:I`` with several ranks on a node (each rank needs its own GPU),
            or more local ranks than visible GPUs.
    """
    if not device.startswith("cuda"):
        return device
    if not ranks.launched and ranks.world_size == 1:
        return device
    if device != "cuda":
        if ranks.local_world_size > 1:
            raise BadArgs(f"--device {device} names one GPU, but {ranks.local_world_size} ranks run "
                          "on this node; give --device cuda (rank r uses cuda:LOCAL_RANK)")
        return device
    if ranks.local_rank >= n_gpus:
        raise BadArgs(f"{ranks.local_world_size} ranks on this node but {n_gpus} visible GPUs; "
                      "start at most one rank per GPU (--nproc-per-node)")
    return f"cuda:{ranks.local_rank}"


class Group:
    """The runner's process group: object broadcast and gather over gloo (a no-op wrapper for
    a plain single-process run)."""

    def __init__(self, ranks: Ranks, active: bool, owns: bool = True):
        self.ranks = ranks
        self.active = active  # collectives go through torch.distributed
        self.owns = owns and active  # this object formed the group (and destroys it)

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (waits for all of them)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        """Leave the process group (if this object formed one)."""
        if self.owns:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self.active = self.owns = False


def start_group(ranks: Ranks, device: str, timeout_min: float) -> Group:
    """Join the launcher's process group (``env://``): ``gloo`` on CPU, ``cpu:gloo,cuda:nccl``
    on CUDA (then one all-reduce on ``device`` checks NCCL and the GPU assignment before any
    work). A plain run gets an inactive :class:`Group`.

    Args:
        ranks: from :func:`ranks_from_env`.
        device: this rank's first torch device (``cpu`` or ``cuda:I``).
        timeout_min: collective timeout in minutes (the final gather waits for the slowest
            rank; a rank that dies is reported by the launcher, which stops the others).
    """
    if not ranks.launched:
        return Group(ranks, False)
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # an embedding program formed it (e.g. accelerate's Accelerator)
        if dist.get_world_size() != ranks.world_size or dist.get_rank() != ranks.rank:
            raise BadArgs(f"a process group of world size {dist.get_world_size()} (rank "
                          f"{dist.get_rank()}) exists, but the environment says WORLD_SIZE="
                          f"{ranks.world_size}, RANK={ranks.rank}")
        return Group(ranks, True, owns=False)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_min),
                            rank=ranks.rank, world_size=ranks.world_size)
    if cuda:
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        if int(t.item()) != ranks.world_size:
            raise RuntimeError(f"NCCL check: all-reduce of ones gave {t.item()}, expected "
                               f"{ranks.world_size}")
    return Group(ranks, True)
