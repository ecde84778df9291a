"""The ranks of a run launched by torchrun or accelerate launch, and what they say to each other.

    torchrun --nproc-per-node N -m groundtune train CONFIG [k=v ...]      (and the same for rl)

Every rank trains on its own share of each global batch (train/batches.py, data/samples.py);
the engine that combines their gradients is the run's ``distributed`` setting (train/parallel.py).
Each rank divides its summed loss by the answer tokens of the GLOBAL batch, so N ranks x batch B
update exactly as one process with batch N x B does.

Rank 0 alone writes the run (folder, metrics, checkpoints, model); training-time eval is answered
by every rank, each its share of the eval subset, and scored by rank 0. The decisions that end or
skip a step (STOP, SIGTERM, a non-finite loss) are taken by all ranks together.
Launched without torchrun, there is one rank and nothing here communicates.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0  # the rank on this machine: its GPU
    launched: bool = False  # started by a launcher (torchrun, accelerate launch), even as its only rank

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1


def from_environment() -> Ranks:
    """The ranks torchrun (or accelerate launch) describes in the environment; one without it."""
    if "WORLD_SIZE" not in os.environ:
        return Ranks()
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")), True)


def start(ranks: Ranks) -> None:
    """Join the process group: NCCL between GPUs, gloo on CPUs. Each rank's GPU is its local rank.
    The timeout is long: rank 0 evaluates and writes checkpoints while the others wait."""
    if not ranks.launched or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ranks.local)
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))


def finish(ranks: Ranks, wait: bool = True) -> None:
    """Leave the process group, once every rank is done (``wait``: rank 0 may still be saving the
    model): a process that exits with the group's threads running aborts."""
    if ranks.launched and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another rank is gone (gloo: the
    connection closed; NCCL: the communicator aborted) rather than a problem of this rank."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                         "NCCL communicator was aborted", "remote worker crashing"))


def device_for(ranks: Ranks, device: str) -> str:
    """The device setting for this rank: "cuda" or "auto" on a GPU machine means its own GPU."""
    if ranks.launched and torch.cuda.is_available() and device in ("auto", "cuda"):
        return f"cuda:{ranks.local}"
    return device


def total(value: float, ranks: Ranks, device: torch.device) -> float:
    """``value`` summed over the ranks."""
    if not ranks.many:
        return value
    t = torch.tensor(float(value), dtype=torch.float64, device=_comm_device(device))
    dist.all_reduce(t)
    return float(t)


def any_rank(flag: bool, ranks: Ranks, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (a STOP, a non-finite loss: everyone acts on it)."""
    return total(1.0 if flag else 0.0, ranks, device) > 0


def gather(obj, ranks: Ranks) -> list | None:
    """Every rank's ``obj``, in rank order, on rank 0 (None on the others)."""
    if not ranks.many:
        return [obj]
    gathered = [None] * ranks.world if ranks.main else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def everyone(obj, ranks: Ranks) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not ranks.many:
        return [obj]
    gathered = [None] * ranks.world
    dist.all_gather_object(gathered, obj)
    return gathered


def share(obj, ranks: Ranks):
    """Rank 0's ``obj`` on every rank."""
    if not ranks.many:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _comm_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")
