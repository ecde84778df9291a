"""Training samples, model-agnostic: (image, record) pairs from a file or the synthetic stream, in
a resumable order. (train/batches.py turns them into a model's inputs.)

The order is a function of (seed, position) alone: position p is sample perm_e[p mod n] of epoch
e = p div n. So a run resumed at position p sees exactly the samples an uninterrupted run would
have seen.

Training data is a canonical JSONL file, or ``synth:TASK`` (a task of ``synth.TASKS``: ``synth:full``,
``synth:multi``, ...): the built-in synthetic set drawn in the loader's worker processes as it is
consumed, sample p of the stream being synthetic sample p of the run's seed. Nothing is written to
disk and no sample repeats, so pre-training is never bounded by how many PNGs were made beforehand.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from pathlib import Path

import torch
from PIL import Image

from groundtune.data import synth
from groundtune.data.images import load_image
from groundtune.data.records import image_path, read_samples, record_size
from groundtune.errors import ConfigError, shown

SYNTH_PREFIX = "synth:"
SYNTH_STREAM_LENGTH = 2**62  # "endless": a run stops at max_steps long before


class FileSamples:
    """Records of a canonical JSONL file; images are read from disk as they are needed."""

    shuffle = True  # each epoch in a new order

    def __init__(self, samples: list[dict], data_path: str | Path):
        self.samples, self.data_path = samples, Path(data_path)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Image.Image, dict]:
        sample = self.samples[index]
        return load_image(self.image_file(index), record_size(sample)), sample

    def image_file(self, index: int) -> Path:
        return image_path(self.samples[index], self.data_path)

    def where(self, index: int) -> str:
        """Sample ``index`` for an error message: its id and image file."""
        return f"{self.data_path}: sample {shown(self.samples[index].get('id'))} ({self.image_file(index)})"


class SyntheticStream:
    """``synth:TASK``: synthetic sample i of (seed, "train"), drawn when it is asked for.
    ``synth:TASK1+TASK2``: a mixture, sample i of task i mod 2 (a curriculum that keeps a harder
    task in every batch, e.g. ``synth:full+attribute``). ``synth:TASKS@MIN-MAX``: each sample on a
    canvas whose sides are drawn from MIN..MAX px (``synth.canvas_size``), else 112 x 112.
    ``contrast`` draws its pairs (one image, two phrases) from a sequence of its own, so that a pair
    lands in one batch: in ``synth:every+contrast`` with batches of 4, a batch is every, contrast
    pair j's first phrase, every, pair j's second phrase (batch sizes that are a multiple of twice the
    number of tasks keep every pair together)."""

    shuffle = False  # fresh samples in index order: nothing to shuffle, nothing repeats

    def __init__(self, spec: str, seed: int):
        tasks, _, canvas = spec.partition("@")
        try:
            self.canvas = synth.parse_canvas(canvas) if canvas else None
        except ValueError as e:
            raise ConfigError(f"train_data={shown('synth:' + spec)}: {e}") from None
        self.spec, self.tasks = spec, tasks.split("+")
        for task in self.tasks:
            if task not in synth.TASKS:
                raise ConfigError(f"train_data={shown('synth:' + spec)}: unknown task {shown(task)}; expected one of "
                                 f"{', '.join(SYNTH_PREFIX + t for t in synth.TASKS)}, or several joined by +, "
                                 "then optionally @MIN-MAX (canvas sides in px)")
        self.seed = seed
        self.contrast_slots = [i for i, task in enumerate(self.tasks) if task == synth.CONTRAST_TASK]

    def __len__(self) -> int:
        return SYNTH_STREAM_LENGTH

    def __getitem__(self, index: int) -> tuple[Image.Image, dict]:
        task = self.tasks[index % len(self.tasks)]
        if task == synth.CONTRAST_TASK:  # the contrast task's own sample number: pairs come in turn
            rounds, slot = divmod(index, len(self.tasks))
            index = rounds * len(self.contrast_slots) + self.contrast_slots.index(slot)
        return synth.make_sample(self.seed, index, task=task, canvas=self.canvas)

    def where(self, index: int) -> str:
        return f"synth:{self.spec} sample {index}"


def open_samples(train_data: str, seed: int) -> FileSamples | SyntheticStream:
    """The training samples named by the ``train_data`` setting."""
    if train_data.startswith(SYNTH_PREFIX):
        return SyntheticStream(train_data[len(SYNTH_PREFIX):], seed)
    return FileSamples(read_samples(train_data), train_data)


class ResumableBatches(torch.utils.data.Sampler):
    """Batches of (index, position) from ``start`` on, cycling through epochs forever (in a new
    order each epoch when ``shuffle``, else in index order). With ``world`` ranks, the order is
    drawn in global batches of ``world * batch_size`` positions, and rank r's batch is the r-th
    slice of each: together the ranks see what one process with the global batch would."""

    def __init__(self, n: int, batch_size: int, seed: int, start: int = 0, shuffle: bool = True, rank: int = 0,
                 world: int = 1):
        self.n, self.batch_size, self.seed, self.start, self.shuffle = n, batch_size, seed, start, shuffle
        self.rank, self.world = rank, world

    def _epoch_order(self, epoch: int):
        if not self.shuffle:
            return range(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def __iter__(self):
        position = self.start + self.rank * self.batch_size  # this rank's slice of the global batch
        order, epoch = None, -1
        while True:
            batch = []
            for _ in range(self.batch_size):
                e = position // self.n
                if e != epoch:
                    order, epoch = self._epoch_order(e), e
                batch.append((int(order[position % self.n]), position))
                position += 1
            position += (self.world - 1) * self.batch_size  # the other ranks' slices
            yield batch


def ignore_stop_signals(worker_id: int) -> None:
    """A worker leaves SIGINT and SIGTERM to the main process: `timeout`, systemd and Slurm signal the
    whole process group, and a worker that died first would cost a run its final checkpoint (or an
    eval in the middle of one). A SIGTERM from the process that started the worker is still obeyed:
    that is how Python ends daemonic workers when the main process exits, and a worker deaf to it
    keeps the main process waiting for it forever (a loader still open at exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS: no way to tell who sent it; ignored, as before
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    # Python's handlers do not see who sent a signal; a thread waiting for SIGTERM, blocked
    # everywhere else, does (threads the worker starts from here on inherit the mask; a loader's
    # worker started through ``worker_context`` has it from its first thread on).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    starter = multiprocessing.parent_process()
    threading.Thread(target=_obey_sigterm_from, args=(starter.pid if starter else os.getppid(),),
                     daemon=True, name="sigterm-from-parent").start()


def worker_context() -> multiprocessing.context.BaseContext | None:
    """The default start method's context for a DataLoader whose workers run ``ignore_stop_signals``:
    each worker process starts with SIGTERM blocked (the starting thread blocks it around the start,
    and a new process inherits its mask), so the threads a worker makes before its init function
    runs block it too. torch makes one (a thread pool's, from the worker's ``set_num_threads(1)``
    where the parent had set a thread count, as every groundtune command does); a group's
    SIGTERM delivered to that thread would end the worker.
    None where signal masks are not (Windows)."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    base = multiprocessing.get_context()

    class Process(base.Process):
        def start(self):
            before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                super().start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)

    return type(f"StopSignalsBlocked{type(base).__name__}", (type(base),), {"Process": Process})()


def stop_signal_workers(workers: int) -> dict:
    """A DataLoader's worker settings for ``workers`` processes that leave a group's Ctrl-C and
    SIGTERM to the main process (``ignore_stop_signals``, ``worker_context``); none for none."""
    return {"worker_init_fn": ignore_stop_signals, "multiprocessing_context": worker_context()} if workers else {}


def _obey_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(128 + signal.SIGTERM)  # as the signal's default action would have ended it
