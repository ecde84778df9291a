"""How the server's model process cuts its inbox into batches (deploy/batching.py ``_batches``):
while the model is free, a batch waits at most ``max_wait_ms`` after its first phrase; while the
model answers the batch before, the next keeps filling until it is full or the model is done."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from groundtune.deploy.batching import _batches, _to_wire

LIMITS = SimpleNamespace(batch_size=4, max_wait_ms=20.0)


def _item(key: int) -> tuple:
    return (key, _to_wire({"input_ids": torch.tensor([key])}), ((8, 8), (8, 8)), time.monotonic(), None)


def _keys(batch) -> list[int]:
    _, _, items = batch
    return [item[0] for item in items]


def test_a_free_model_gets_what_came_within_max_wait():
    waiting, idle = queue.Queue(), threading.Event()
    idle.set()
    batches = _batches(waiting, LIMITS, idle)
    waiting.put(_item(0))
    waiting.put(_item(1))
    started = time.monotonic()
    first = next(batches)
    assert _keys(first) == [0, 1]
    assert 0.015 <= time.monotonic() - started < 1.0  # it waited max_wait_ms for more, not longer
    encoded, sizes, _ = first
    assert [int(e["input_ids"][0]) for e in encoded] == [0, 1] and sizes[0] == ((8, 8), (8, 8))


def test_while_the_model_is_busy_the_next_batch_fills_until_it_is_done():
    waiting, idle = queue.Queue(), threading.Event()
    idle.set()
    batches = _batches(waiting, LIMITS, idle)
    waiting.put(_item(0))
    assert _keys(next(batches)) == [0]  # the model takes it: it is busy from here (idle cleared)
    got = []
    reader = threading.Thread(target=lambda: got.append(next(batches)))
    reader.start()
    waiting.put(_item(1))
    time.sleep(0.1)  # five times max_wait_ms: a free model's batch would have been cut by now
    waiting.put(_item(2))
    reader.join(0.2)
    assert not got, "a batch was cut at max_wait_ms while the model was busy"
    idle.set()  # the model is done: the batch goes as it is
    reader.join(2)
    assert _keys(got[0]) == [1, 2]


def test_a_full_batch_goes_at_once_and_the_inbox_end_ends_the_batches():
    waiting, idle = queue.Queue(), threading.Event()  # the model busy: only fullness can end a batch
    for key in range(6):
        waiting.put(_item(key))
    waiting.put(None)
    batches = _batches(waiting, LIMITS, idle)
    assert _keys(next(batches)) == [0, 1, 2, 3]
    assert _keys(next(batches)) == [4, 5]  # the inbox's end: the phrases before it still answered
    assert next(batches, None) is None


@pytest.mark.parametrize("through", ["pipe", "shared memory"])
def test_a_request_s_pixels_cross_to_the_model_once_and_every_phrase_gets_them(through, small_model, monkeypatch):
    """The encoding side sends an image's pixels with its first phrase only (a 3B image is ~20 MB,
    copied through the queue once per phrase before); the model's side puts them back in every
    phrase's prompt and forgets them after the last. Through shared memory (every tensor, with
    SHARED_FROM_BYTES at 0), the model's side removes each block as it takes it."""
    import io
    import pickle
    from multiprocessing import shared_memory

    from groundtune import infer
    from groundtune.data import synth
    from groundtune.deploy import batching
    from groundtune.deploy.batching import (
        _encode_and_send,
        _from_wire,
        _received,
        _with_pixels,
    )
    from groundtune.deploy.limits import Limits
    from groundtune.deploy.reading import Encoder

    if through == "shared memory":
        monkeypatch.setattr(batching, "SHARED_FROM_BYTES", 0)

    gm = infer.load(small_model, device="cpu")
    image, _ = synth.make_sample(5, 0)
    png = io.BytesIO()
    image.save(png, format="PNG")
    phrases = ["the red circle", "the blue square", "every shape"]
    inbox = queue.Queue()
    _encode_and_send(Encoder(gm, Limits()), inbox, [10, 11, 12], png.getvalue(), phrases, "image")
    sent = [inbox.get_nowait() for _ in phrases]
    sizes = [len(pickle.dumps(item)) for item in sent]
    assert sent[0][1]["pixel_values"] is not None and all(item[1]["pixel_values"] is None for item in sent[1:])
    if through == "pipe":
        assert max(sizes[1:]) < sizes[0] / 2  # the followers carry no pixels

    blocks = [v[1].name for item in sent for v in item[1].values() if v is not None and isinstance(v[1], batching._Shared)]
    assert len(blocks) == (0 if through == "pipe" else len(sent[0][1]) + 2 * (len(sent[1][1]) - 1))
    if through == "shared memory":
        assert max(sizes) < 2000  # the pixels left the pipe

    kept: dict = {}
    received = [_with_pixels(_received(item), kept) for item in sent]
    assert not kept  # the last phrase took them
    for name in blocks:  # taken, and gone from the system
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    alone = [infer.PromptEncoder(gm).many(image, [phrase], "the image")[0][0] for phrase in phrases]
    for item, expected in zip(received, alone):
        encoded = _from_wire(item[1])
        assert torch.equal(encoded["pixel_values"], expected["pixel_values"])
        assert torch.equal(encoded["input_ids"], expected["input_ids"])


def test_with_no_room_in_shared_memory_the_pixels_take_the_pipe(monkeypatch):
    """A write past a full /dev/shm (64 MB in many containers) would kill the encoding process with
    SIGBUS: without room for twice the block and a margin, the array goes through the pipe."""
    import os

    import numpy as np

    from groundtune.deploy import batching

    array = np.arange(300_000, dtype=np.int16)
    full = os.statvfs_result((4096, 4096, 1000, 10, 10, 100, 10, 10, 0, 255))
    monkeypatch.setattr(batching.os, "statvfs", lambda path: full)
    assert batching._Shared.put(array) is None
    monkeypatch.undo()
    shared = batching._Shared.put(array)
    assert shared is not None and np.array_equal(shared.take(), array)
