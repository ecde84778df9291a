"""Training samples: canonical records -> model inputs, in a resumable order.

The order is a function of (seed, position) alone: position p is sample perm_e[p mod n] of epoch
e = p div n, and the augmentation of position p draws from a generator seeded with (seed, p). So a
run resumed at position p sees exactly the batches an uninterrupted run would have seen.

Training data is a canonical JSONL file, or ``synth:TASK`` (a task of ``synth.TASKS``: ``synth:full``,
``synth:multi``, ...): the built-in synthetic set drawn in the loader's worker processes as it is
consumed, sample p of the stream being synthetic sample p of the run's seed. Nothing is written to
disk and no sample repeats, so pre-training is never bounded by how many PNGs were made beforehand.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from groundtune import boxes
from groundtune.data import augment, synth
from groundtune.data.images import load_image
from groundtune.data.records import image_path, read_samples, sample_boxes
from groundtune.models import qwen


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
        return load_image(image_path(sample, self.data_path), (sample["width"], sample["height"])), sample


class SyntheticStream:
    """``synth:TASK``: synthetic sample i of (seed, "train"), drawn when it is asked for.
    ``synth:TASK1+TASK2``: a mixture, sample i of task i mod 2 (a curriculum that keeps a harder
    task in every batch, e.g. ``synth:full+attribute``)."""

    shuffle = False  # fresh samples in index order: nothing to shuffle, nothing repeats

    def __init__(self, tasks: str, seed: int):
        self.tasks = tasks.split("+")
        for task in self.tasks:
            if task not in synth.TASKS:
                raise ValueError(f"train_data=synth:{tasks}: unknown task {task!r}; expected one of "
                                 f"{', '.join(SYNTH_PREFIX + t for t in synth.TASKS)}, or several joined by +")
        self.seed = seed

    def __len__(self) -> int:
        return SYNTH_STREAM_LENGTH

    def __getitem__(self, index: int) -> tuple[Image.Image, dict]:
        return synth.make_sample(self.seed, index, task=self.tasks[index % len(self.tasks)])


def open_samples(train_data: str, seed: int) -> FileSamples | SyntheticStream:
    """The training samples named by the ``train_data`` setting."""
    if train_data.startswith(SYNTH_PREFIX):
        return SyntheticStream(train_data[len(SYNTH_PREFIX):], seed)
    return FileSamples(read_samples(train_data), train_data)


class GroundingDataset(torch.utils.data.Dataset):
    """Item ``(index, position)`` -> encoded sample with the answer as its labelled target."""

    def __init__(self, samples: FileSamples | SyntheticStream, processor: qwen.Processor, family: str,
                 resize: boxes.ResizeSpec, prompt: str, hflip_prob: float = 0.0, scale_crop_prob: float = 0.0,
                 seed: int = 0, answer_label: bool = True):
        self.samples = samples
        self.processor = processor
        self.family = family
        self.resize = resize
        self.prompt = prompt
        self.hflip_prob = hflip_prob
        self.scale_crop_prob = scale_crop_prob
        self.seed = seed
        self.answer_label = answer_label

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        index, position = key
        image, sample = self.samples[index]
        rng = np.random.default_rng([self.seed, position])
        if self.hflip_prob and rng.random() < self.hflip_prob:
            image, sample = augment.hflip(image, sample)
        # A crop keeps the target whole but may cut away the shape a phrase is relative to
        # ("left of the red square"), so phrases about positions are never cropped.
        if self.scale_crop_prob and rng.random() < self.scale_crop_prob and not augment.is_positional(sample["phrase"]):
            image, sample = augment.scale_crop(image, sample, rng)
        return encode_sample(self.processor, self.family, self.resize, self.prompt, image, sample,
                             self.answer_label)


def encode_sample(processor, family, resize, prompt, image, sample, answer_label: bool = True) -> dict:
    """Resize the image as the model sees it and write the target in the family's convention."""
    resized, resized_size = qwen.resize_image(image, resize)
    label = sample["phrase"] if answer_label else None
    answer = boxes.format_target(sample_boxes(sample), label, family, image.size, resized_size)
    text = qwen.prompt_text(processor, sample["phrase"], prompt)
    return qwen.encode(processor, resized, text, answer)


class ResumableBatches(torch.utils.data.Sampler):
    """Batches of (index, position) from ``start`` on, cycling through epochs forever (in a new
    order each epoch when ``shuffle``, else in index order)."""

    def __init__(self, n: int, batch_size: int, seed: int, start: int = 0, shuffle: bool = True):
        self.n, self.batch_size, self.seed, self.start, self.shuffle = n, batch_size, seed, start, shuffle

    def _epoch_order(self, epoch: int):
        if not self.shuffle:
            return range(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def __iter__(self):
        position = self.start
        order, epoch = None, -1
        while True:
            batch = []
            for _ in range(self.batch_size):
                e = position // self.n
                if e != epoch:
                    order, epoch = self._epoch_order(e), e
                batch.append((int(order[position % self.n]), position))
                position += 1
            yield batch


def make_loader(dataset: GroundingDataset, batch_size: int, seed: int, start: int, num_workers: int,
                pad_token_id: int, pin_memory: bool = False, packing: bool = False) -> torch.utils.data.DataLoader:
    collate = qwen.collate_packed if packing else partial(qwen.collate, pad_token_id=pad_token_id, padding_side="right")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=ResumableBatches(len(dataset), batch_size, seed, start, dataset.samples.shuffle),
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch from ``make_loader`` on ``device`` (its tensors; a packed batch's lengths are ints)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
