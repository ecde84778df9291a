"""Training batches: samples (data/samples.py) -> a model's inputs, in the loader's worker processes.

Item (index, position) of the dataset is sample ``index`` at ``position`` of the run's order: its
augmentation draws from a generator seeded with (seed, position), so a run resumed at a position
sees exactly the batches an uninterrupted run would have seen.

Every record was checked before the run started (train/loop.py). A sample that fails to load all
the same (its image deleted or damaged since) does not crash a worker: the batch comes without it,
with ``failed`` saying which, and the loop counts it (``Loop.skip_unreadable``). Each batch also
says how many positions of the order it used (``drawn``), failed ones included.
"""

from __future__ import annotations

import numpy as np
import torch

from groundtune import boxes
from groundtune.data import augment
from groundtune.data.records import sample_boxes
from groundtune.data.samples import FileSamples, ResumableBatches, SyntheticStream, stop_signal_workers
from groundtune.errors import DataError
from groundtune.models import head, qwen


class GroundingDataset(torch.utils.data.Dataset):
    """Item ``(index, position)`` -> encoded sample with the answer as its labelled target."""

    def __init__(self, samples: FileSamples | SyntheticStream, processor: qwen.Processor, family: str,
                 resize: boxes.ResizeSpec, prompt: str, hflip_prob: float = 0.0, scale_crop_prob: float = 0.0,
                 seed: int = 0, answer_label: bool = True, box_target: bool = False, answer_text: bool = True):
        self.samples = samples
        self.processor = processor
        self.family = family
        self.resize = resize
        self.prompt = prompt
        self.hflip_prob = hflip_prob
        self.scale_crop_prob = scale_crop_prob
        self.seed = seed
        self.answer_label = answer_label
        self.box_target = box_target  # head=box: each sample's boxes as fractions of the image too
        self.answer_text = answer_text  # head=box: False where nothing trains the text answer (encode_sample)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        try:
            return self._encoded(*key)
        except DataError as e:  # checked before the run, broken since: skipped and counted by the loop
            return {"failed": str(e)}

    def _encoded(self, index: int, position: int) -> dict[str, torch.Tensor]:
        image, sample = self.samples[index]
        rng = np.random.default_rng([self.seed, position])
        if self.hflip_prob and rng.random() < self.hflip_prob:
            image, sample = augment.hflip(image, sample)
        # A crop keeps the target whole but may cut away the shape a phrase is relative to
        # ("left of the red square"), so phrases about positions are never cropped.
        if self.scale_crop_prob and rng.random() < self.scale_crop_prob and not augment.is_positional(sample["phrase"]):
            image, sample = augment.scale_crop(image, sample, rng)
        try:
            encoded = encode_sample(self.processor, self.family, self.resize, self.prompt, image, sample,
                                    self.answer_label, self.box_target, self.answer_text)
        except boxes.ResizeError as e:
            raise DataError(f"{self.samples.where(index)}: {e}") from None
        if self.box_target:  # every box, none for a no-target phrase: the head's slots match them (models/head.py)
            unit = [boxes.to_unit(box, image.size) for box in sample_boxes(sample)]
            encoded["box_target"] = torch.tensor(unit, dtype=torch.float32).reshape(len(unit), 4)
        return encoded


def encode_sample(processor, family, resize, prompt, image, sample, answer_label: bool = True,
                  box_head: bool = False, answer_text: bool = True) -> dict:
    """Resize the image as the model sees it and write the target in the family's convention.
    ``box_head``: the prompt ends with the answer's opening (``head.prompt_end``), where the head
    reads; the answer (which only the joint mode trains) is the rest, without a label; with
    ``answer_text`` False, none of it: a causal model's states at the prompt and the image, all the
    head reads, are the same without it, and a run that trains no text answer would pay the
    forward and backward pass of its ~30 tokens for nothing (the closing tokens stay, labelled:
    they mark where the prompt ends, ``head.query_positions``). The phrase, in the prompt and as
    the answer's label, is text (``qwen.PhraseText``)."""
    resized, resized_size = qwen.resize_image(image, resize)

    def target(label: str | None) -> str:
        return boxes.format_target(sample_boxes(sample), label, family, image.size, resized_size)

    opening = head.prompt_end(family) if box_head else ""
    if answer_label and not box_head:
        answer = qwen.PhraseText.written(target, sample["phrase"])
    else:
        answer = target(None)[len(opening):] if answer_text or not box_head else ""
    text = qwen.prompt_text(processor, sample["phrase"], prompt, answer_start=opening)
    return qwen.encode(processor, resized, text, answer)


class Collate:
    """Items -> one batch (padded, or packed into one row), with ``drawn`` (positions used) and
    ``failed`` (what went wrong with the items that failed to load). A box head's targets:
    ``box_target`` (samples, most boxes, 4), zero-padded, and ``box_count`` (samples,), how many
    of each sample's rows are boxes."""

    def __init__(self, pad_token_id: int, packing: bool = False):
        self.pad_token_id, self.packing = pad_token_id, packing

    def __call__(self, items: list[dict]) -> dict:
        good = [item for item in items if "failed" not in item]
        targets = [item.pop("box_target") for item in good if "box_target" in item]
        batch = {}
        if good:
            batch = qwen.collate_packed(good) if self.packing else qwen.collate(good, self.pad_token_id, "right")
        if targets:
            batch["box_target"] = torch.nn.utils.rnn.pad_sequence(targets, batch_first=True)
            batch["box_count"] = torch.tensor([len(t) for t in targets])
        return {**batch, "drawn": len(items), "failed": [item["failed"] for item in items if "failed" in item]}


def make_loader(dataset: GroundingDataset, batch_size: int, seed: int, start: int, num_workers: int,
                pad_token_id: int, pin_memory: bool = False, packing: bool = False, rank: int = 0,
                world: int = 1) -> torch.utils.data.DataLoader:
    """Batches of ``batch_size`` from position ``start`` of the run's order; with ``world`` ranks,
    this rank's share of each global batch of ``world * batch_size``."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=ResumableBatches(len(dataset), batch_size, seed, start, dataset.samples.shuffle, rank, world),
        collate_fn=Collate(pad_token_id, packing),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        **stop_signal_workers(num_workers),
    )


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch from ``make_loader`` on ``device`` (its tensors; a packed batch's lengths are ints)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
