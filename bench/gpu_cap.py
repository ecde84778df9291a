"""The GPU memory cap every bench measures under: the process behaves like a smaller card.

    from gpu_cap import cap_gpu_memory     # bench/ is the script's folder: on sys.path
    cap_gpu_memory(24)                     # a 24 GB card
"""

from __future__ import annotations

import torch


def cap_gpu_memory(gib: float) -> None:
    """Cap this process's CUDA allocations at ``gib`` GiB (the whole GPU if it holds less); nothing
    without a GPU. Only the measuring process should call it: what it allocates is what is reported."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
