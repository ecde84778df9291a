"""Data parallel training across processes (`torchrun --nproc-per-node N -m groundtune train ...`).

Every rank holds the whole model and trains on its own share of each global batch; after the
backward, the gradients are summed across ranks (one all-reduce of their flattened values), and
each rank divides its summed loss by the answer tokens of the GLOBAL batch, so N ranks x batch B
update exactly as one process with batch N x B does. Done by hand rather than by wrapping the
model in DistributedDataParallel: the objective runs the unwrapped model (train/objective.py),
which DDP's hooks would never see.

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

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1


def from_environment() -> Ranks:
    """The ranks torchrun (or accelerate launch) describes in the environment; one without it."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return Ranks()
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def start(ranks: Ranks) -> None:
    """Join the process group: NCCL between GPUs, gloo on CPUs. Each rank's GPU is its local rank.
    The timeout is long: rank 0 evaluates and writes checkpoints while the others wait."""
    if not ranks.many or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ranks.local)
    dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))


def finish(ranks: Ranks, wait: bool = True) -> None:
    """Leave the process group, once every rank is done (``wait``: rank 0 may still be saving the
    model): a process that exits with the group's threads running aborts."""
    if ranks.many and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def device_for(ranks: Ranks, device: str) -> str:
    """The device setting for this rank: "cuda" or "auto" on a GPU machine means its own GPU."""
    if ranks.many and torch.cuda.is_available() and device in ("auto", "cuda"):
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


def sum_gradients(parameters, ranks: Ranks) -> None:
    """Each trainable parameter's gradient summed over the ranks, in one all-reduce of them all."""
    if not ranks.many:
        return
    grads = [p.grad for p in parameters if p.requires_grad and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def gather(obj, ranks: Ranks) -> list | None:
    """Every rank's ``obj``, in rank order, on rank 0 (None on the others)."""
    if not ranks.many:
        return [obj]
    gathered = [None] * ranks.world if ranks.main else None
    dist.gather_object(obj, gathered, dst=0)
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
