"""The server's model and its batching: the processes behind `groundtune serve` (serve.py is the
HTTP in front of them).

Three kinds of process (all started by the server, all ended with it):
- the server's own: HTTP (uvicorn's event loop), the checks on each request, and the answers;
- encoding workers (``--workers``; on a CPU machine threads of the server instead): each
  request's image decoded and its prompts encoded as it arrives (``infer.encode_prompt``, the
  resize and prompt of training), straight into the model's inbox, so the next batch is ready
  while the model answers this one;
- the model's (``_model_process``): the prompts waiting (up to ``batch_size``, for at most
  ``max_wait_ms`` after the first) go through ONE ``infer.generate`` call on the inference
  engine. It has the process to itself: sharing the server's interpreter with the event loop, a
  batch of the tiny model on the CPU took ~30% longer (docs/benchmarks-history.md, "Serving").

The queue is bounded (phrases sent to the model and not answered yet): ``Model.answer`` raises
QueueFull past ``queue_size``, which the server answers 503. What turns a request into prompts is
the server's (``serve.Encoder``: it decodes the caller's bytes and refuses them in HTTP's terms);
this module carries the prompts it makes, and reads of the server's ``Limits`` only batch_size,
max_wait_ms, queue_size, workers and decode_budget_bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from PIL import Image

from groundtune.progress import quiet_libraries


def prepare_decoding() -> None:
    """Set up a process of the server that decodes images (the server's own, an encoding worker).

    Pillow's own decompression-bomb limit off: ours (``--max-image-pixels``) is checked first, on
    the frame's own header, and Pillow's would refuse what is over 179 MP with its own text before
    ours was read.

    glibc (Linux): every block of 1 MB or more mmap'd on its own, so that it goes back to the
    system when freed. glibc's default raises that threshold as such blocks are freed (to 32 MB),
    after which an image's 16 MB Pillow blocks and numpy arrays land in the heaps of the decoding
    threads' arenas, which keep them: after six 50 MP 16-bit PNGs the server kept 900 MB more than
    before them. Setting the threshold also turns that raising off."""
    import ctypes

    Image.MAX_IMAGE_PIXELS = None
    try:
        ctypes.CDLL(None).mallopt(-3, 2**20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # another C library (musl, macOS): its own ways stand
        pass


# --------------------------------------------------------------------------------------------
# The encoding workers: each request's prompts, made as it arrives, into the model's inbox


# A tensor this large (an image's pixels) crosses to the model's process through a shared-memory
# block; smaller ones (token ids, grids) go through the queue's pipe with the rest of the item.
SHARED_FROM_BYTES = 1 << 20
SHARED_MEMORY = "/dev/shm"  # where Linux keeps those blocks (a container's is often 64 MB)


class _Shared(NamedTuple):
    """An array the encoding side left in a shared-memory block, for the model's process to take.

    Through the pipe, a 3B image's ~4 MB of pixels is read in 64 KB pieces by a thread of the
    model's process, each piece waiting for the interpreter while the model's own thread holds it
    (``bench/serve_transport.py``, 2 cores: ~4 MB items reached a process whose main thread was
    idle at 47 a second through the pipe and 739 in shared memory; with its main thread running
    Python, 3 against 24). Eval's loader hands its tensors over in shared memory too. A block is
    taken (copied out and removed) as soon as the model's process reads the item; one left by a
    process that died goes with the server (the blocks are registered with multiprocessing's
    resource tracker, which removes what is left)."""

    name: str
    shape: tuple
    dtype: str

    @classmethod
    def put(cls, array: np.ndarray) -> _Shared | None:
        """``array`` copied into a new block; None where the system has no room for it (the pipe
        carries it then: a write past a full /dev/shm would kill the process with SIGBUS)."""
        from multiprocessing import shared_memory

        try:
            free = os.statvfs(SHARED_MEMORY)
            if free.f_bavail * free.f_frsize < 2 * array.nbytes + (64 << 20):
                return None
        except OSError:  # no such folder (macOS keeps them elsewhere): try
            pass
        try:
            block = shared_memory.SharedMemory(create=True, size=array.nbytes)
        except OSError:
            return None
        view = np.ndarray(array.shape, array.dtype, block.buf)
        view[...] = array
        del view  # the block cannot be closed while a view of it lives
        block.close()
        return cls(block.name, array.shape, array.dtype.str)

    def take(self) -> np.ndarray:
        from multiprocessing import shared_memory

        block = shared_memory.SharedMemory(name=self.name)
        try:
            view = np.ndarray(self.shape, np.dtype(self.dtype), block.buf)
            array = view.copy()
            del view
        finally:
            block.close()
            block.unlink()
        return array


def _to_wire(encoded: dict) -> dict:
    """An encoded prompt's tensors as numpy arrays, the large ones in shared memory (``_Shared``).
    Not torch's own sharing: it hands each tensor over as a file descriptor, one open per tensor
    in flight."""
    import torch

    def wire(tensor: torch.Tensor):  # numpy has no bfloat16: its bits, as int16
        bf16 = tensor.dtype == torch.bfloat16
        array = (tensor.view(torch.int16) if bf16 else tensor).numpy()
        shared = _Shared.put(array) if array.nbytes >= SHARED_FROM_BYTES else None
        return bf16, shared if shared is not None else array

    return {k: wire(v) for k, v in encoded.items()}


def _received(item: tuple) -> tuple:
    """An inbox item with its shared-memory blocks taken, as soon as the model's process reads it."""
    key, wire, *rest = item
    taken = {k: v if v is None or not isinstance(v[1], _Shared) else (v[0], v[1].take()) for k, v in wire.items()}
    return (key, taken, *rest)


def _from_wire(encoded: dict) -> dict:
    import torch

    def tensor(value) -> torch.Tensor:
        bf16, array = value
        t = torch.from_numpy(array)
        return t.view(torch.bfloat16) if bf16 else t

    return {k: tensor(v) for k, v in encoded.items()}


def _encode_and_send(encoder, inbox, keys: list[int], data: bytes, phrases: list[str], param: str,
                     max_tokens: int | None = None) -> tuple[int, int, list[int]]:
    """Encode a request and put its prompts in the model's inbox, one item per phrase, each answer
    to be cut at ``max_tokens`` (None: the server's --max-new-tokens); returns the image's size and
    each prompt's length in tokens. Nothing is sent for a request that fails (a RequestError for
    the caller).

    The image's pixels go once, with the first phrase: a later phrase's item carries None in their
    place and, as every item does, (the first phrase's key, the request's phrase count), from which
    the model's process puts them back (``_with_pixels``). A 3B image is ~20 MB of pixels, copied
    through the queue once per phrase before."""
    width, height, prompts = encoder(data, phrases, param)
    queued = time.monotonic()  # the system's monotonic clock: the model's process reads it too
    request = (keys[0], len(prompts))
    for i, (key, (encoded, sizes)) in enumerate(zip(keys, prompts)):
        shared = i > 0 and encoded["pixel_values"] is prompts[0][0]["pixel_values"]
        wire = _to_wire({k: v for k, v in encoded.items() if not (shared and k == "pixel_values")})
        inbox.put((key, wire if not shared else {**wire, "pixel_values": None}, sizes, queued, max_tokens, request))
    return width, height, [int(encoded["input_ids"].shape[-1]) for encoded, _ in prompts]


def _with_pixels(item: tuple, kept: dict) -> tuple:
    """An inbox item with its request's pixels put back where ``_encode_and_send`` left None: kept
    from the request's first item (which comes first: one sender puts a request's items in order)
    until its last phrase has taken them."""
    key, wire, *rest, (first, phrases) = item
    if phrases > 1:
        if key == first:
            kept[first] = [wire["pixel_values"], phrases - 1]
        else:
            pixels = kept[first]
            pixels[1] -= 1
            if pixels[1] == 0:
                del kept[first]
            if wire["pixel_values"] is None:
                wire = {**wire, "pixel_values": pixels[0]}
    return (key, wire, *rest, (first, phrases))


_worker_state: tuple | None = None  # an encoding process's (encoder, inbox)


def _start_worker(encoder, inbox) -> None:
    global _worker_state
    import torch

    _detach_from_server()
    quiet_libraries()
    prepare_decoding()
    torch.set_num_threads(1)  # one image at a time each: the workers together use the cores
    inbox.cancel_join_thread()  # at exit, prompts the model will never read are not waited for
    _worker_state = (encoder, inbox)


def _encode_in_worker(keys: list[int], data: bytes, phrases: list[str], param: str,
                      max_tokens: int | None) -> tuple[int, int, list[int]]:
    return _encode_and_send(*_worker_state, keys, data, phrases, param, max_tokens)


def _worker_ready() -> None:
    """A task that only shows its worker has started."""


def _detach_from_server() -> None:
    """In a process the server started: Ctrl-C and SIGTERM stop the server, which ends this process;
    a server killed outright (SIGKILL, out of memory) cannot, so this process ends itself then."""
    import os
    import threading

    from groundtune.data.samples import ignore_stop_signals

    ignore_stop_signals(0)
    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True).start()


# --------------------------------------------------------------------------------------------
# The model's process


def _model_process(model: str, device: str, limits, max_new_tokens: int, compile: bool, make_encoder, inbox, outbox,
                   ready) -> None:
    """The model, in a process of its own so that nothing competes with its thread for the
    interpreter (the server's event loop did: a batch took ~30% longer on the CPU). Loads
    ``model``, says ("ready", make_encoder(gm, limits), family, device) or ("error", exception) on ``ready``, then
    answers batches: the items waiting in ``inbox`` (``_batches``) on eval's own path
    (``infer.answer_batches``: the next batch put in its row while the model answers this one),
    the predictions to ``outbox`` as ([(key, Answered or an error's text)], the batch's stats).
    None in the inbox ends it.

    The batch is generated to ``max_new_tokens``; an item's own ``max_tokens`` (OpenAI's, fewer)
    cuts its answer there and reads it again: decoding is greedy, so the first k tokens are what a
    limit of k would have given."""
    import pickle
    import queue
    import threading

    from groundtune import infer

    _detach_from_server()
    quiet_libraries()
    try:
        gm = infer.load(model, device=device, compile=compile)
    except BaseException as e:  # noqa: BLE001 - said by the server, which exits with it
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        ready.send(("error", e))
        return
    engine, decoding = infer.engine_for(gm), infer.Decoding.greedy(max_new_tokens)
    outbox.cancel_join_thread()  # at exit, answers to a server that is gone are not waited for
    ready.send(("ready", make_encoder(gm, limits), gm.family, str(gm.device)))

    waiting: queue.Queue = queue.Queue()

    def read_inbox() -> None:  # (its items unpickled) on a thread of its own, while the model works
        kept: dict = {}  # the pixels of requests some of whose phrases are still to come
        for item in iter(inbox.get, None):
            waiting.put(_with_pixels(_received(item), kept))
        waiting.put(None)

    threading.Thread(target=read_inbox, daemon=True).start()
    idle = threading.Event()  # the model has answered its batch and waits for the next
    idle.set()
    batches = infer.answer_batches(gm, _batches(waiting, limits, idle), decoding, engine, read_ahead=True,
                                   keep_going=True)  # eval's path: the next batch in its row while this one runs
    asked = time.monotonic()  # when the model was free for the next batch
    for batch, answers in batches:
        done = time.monotonic()
        began = max(asked, batch.formed)  # the model's time on it: from when both it and the batch were ready
        try:  # the server must outlive a failed batch: its phrases get the error
            if isinstance(answers, Exception):
                raise answers
            results = [(item[0], _answered(gm, ids, prediction, item[2], item[4]))
                       for item, (ids, prediction) in zip(batch, answers)]
        except Exception as e:  # noqa: BLE001
            results = [(item[0], f"{type(e).__name__}: {e}") for item in batch]
        outbox.put((results, {"size": len(batch), "seconds": done - began,
                              "waits": [began - item[3] for item in batch]}))
        asked = time.monotonic()
        idle.set()


class _Batch(list):
    """A batch's inbox items, and when it was complete (time.monotonic)."""

    formed: float = 0.0


def _batches(waiting, limits, idle) -> Iterator[tuple[list[dict], list[tuple], _Batch]]:
    """The inbox's items in batches, as ``infer.answer_batches`` takes them: up to ``batch_size``,
    for at most ``max_wait_ms`` after the first while the model is ``idle``. While the model
    answers the batch before, the next one fills until it is full or the model is done, and only
    then goes into its row: a batch cut at ``max_wait_ms`` while the model was busy anyway would
    only be smaller. Ends with the inbox (its None)."""
    import queue

    while True:
        first = waiting.get()
        if first is None:
            return
        batch, deadline, stop = _Batch([first]), time.monotonic() + limits.max_wait_ms / 1000, False
        while len(batch) < limits.batch_size:
            now = time.monotonic()
            wait = max(0.0, deadline - now) if idle.is_set() else 0.002  # busy: look at the model again soon
            try:  # what waits already is taken at once; then more, as above
                item = waiting.get_nowait() if not waiting.empty() else waiting.get(timeout=wait)
            except queue.Empty:
                if idle.is_set() and time.monotonic() >= deadline:
                    break
                continue
            if item is None:
                stop = True
                break
            batch.append(item)
        batch.formed = time.monotonic()
        yield [_from_wire(item[1]) for item in batch], [item[2] for item in batch], batch
        # asked again: the model has taken this batch and answers it (until it sets ``idle``)
        idle.clear()
        if stop:
            return


class Answered(NamedTuple):
    """One phrase's answer as the model's process sends it."""

    prediction: object  # infer.Prediction
    tokens: int  # the answer's tokens, its stop token included
    stopped: bool  # it ended itself (False: cut at the token limit)


def _answered(gm, ids: list[int], prediction, sizes: tuple, max_tokens: int | None) -> Answered:
    from groundtune import infer

    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:max_tokens]
        prediction = infer.read_answer(ids, gm.processor, gm.family, *sizes)
    # generate keeps an answer's stop token: an answer without one was cut (a box head's has no tokens)
    stopped = not ids or infer.answer_length(ids, gm.processor) < len(ids)
    return Answered(prediction, len(ids), stopped)


class QueueFull(Exception):
    pass


class Answer(NamedTuple):
    width: int  # the caller's image as a viewer shows it
    height: int
    answers: list[Answered]  # one per phrase
    prompt_tokens: list[int]  # each phrase's prompt, the image's tokens included
    encoded_at: float  # time.perf_counter() when the prompts were ready and queued

    @property
    def predictions(self) -> list:
        return [a.prediction for a in self.answers]


class Model:
    """The server's side of the model's process: starts it (and the encoding workers), sends it
    each request's prompts, and hands its answers to the requests that wait for them.

    ``make_encoder(gm, limits)``, called in the model's process once the model is loaded, makes
    what the encoding workers keep (picklable; serve.Encoder): ``encoder(data, phrases, param)``
    -> (width, height, [(encoded prompt, sizes)]) and ``encoder.decoding_bytes(data, param)``,
    the memory decoding ``data`` will hold, read from its header. Either raises the caller's
    mistake as the server says it (serve.RequestError)."""

    def __init__(self, model: str, device: str, limits, max_new_tokens: int, make_encoder, compile: bool = False):
        import multiprocessing

        from groundtune import infer

        self.limits, self.metrics = limits, None
        # spawned, not forked: the server has threads by now
        self.context = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = self.context.Queue(), self.context.Queue()
        ours, theirs = self.context.Pipe()
        self.process = self.context.Process(target=_model_process, name="groundtune-model",
                                            args=(model, device, limits, max_new_tokens, compile, make_encoder, self.inbox,
                                                  self.outbox, theirs))
        self.process.start()
        theirs.close()
        self.pool = None
        try:
            said, *what = ours.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the model's process exited with {self.process.exitcode} while loading "
                               f"{model}") from None
        except BaseException:  # Ctrl-C while it loads: it ignores the signal, and would be waited for
            self.close()
            raise
        if said == "error":
            self.process.join()
            raise what[0]
        self.encoder, self.family, device = what  # the device it chose ("auto" resolved)
        self.workers = infer.default_workers(device) if limits.workers is None else limits.workers
        self.max_new_tokens = max_new_tokens
        self.pending: dict[int, tuple] = {}  # key -> (loop, future): the phrases sent and not answered
        self.next_key = 0
        self.budget = DecodeBudget(limits.decode_budget_bytes)
        self.died: str | None = None
        self.on_death = None  # what the server does then (serve: stop)

    async def start(self, metrics) -> None:
        import threading

        self.metrics = metrics
        threading.Thread(target=self._read_answers, daemon=True).start()
        if self.workers:  # started (each submit starts one) and imported before the server says it is up
            self.pool = self._new_pool()
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(self.pool, _worker_ready) for _ in range(self.workers)))

    def _new_pool(self):
        from concurrent.futures import ProcessPoolExecutor

        return ProcessPoolExecutor(self.workers, mp_context=self.context, initializer=_start_worker,
                                   initargs=(self.encoder, self.inbox))

    async def stop(self) -> None:
        """The workers and the model's process ended and waited for (the server's shutdown)."""
        self.inbox.cancel_join_thread()  # prompts the model will not read are not waited for at exit
        if self.pool is not None:
            await asyncio.to_thread(self.pool.shutdown, wait=True, cancel_futures=True)
        if self.process.is_alive():
            self.inbox.put(None)
            await asyncio.to_thread(self.process.join, 30)
            if self.process.is_alive():
                self.process.kill()

    def close(self) -> None:
        """What ``stop`` did not end (a server that failed or was stopped before it started) ended
        now: the model's process ignores the signals that stop the server."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def answer(self, data: bytes, phrases: list[str], param: str = "image",
                     max_tokens: int | None = None) -> Answer:
        """The predictions for ``phrases`` in the image file ``data`` (answers cut at ``max_tokens``);
        QueueFull when they do not fit the queue, the encoder's error (a RequestError naming
        ``param``) for an image the server or the model cannot take. The image's header is read
        first (a bad one is refused before anything waits), then the memory its decoding holds is
        reserved from the decode budget until its prompts are encoded."""
        from concurrent.futures.process import BrokenProcessPool

        if self.died:
            raise RuntimeError(self.died)
        decoding = await asyncio.to_thread(self.encoder.decoding_bytes, data, param)
        if len(self.pending) + len(phrases) > self.limits.queue_size:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        keys = list(range(self.next_key, self.next_key + len(phrases)))
        self.next_key += len(phrases)
        futures = [loop.create_future() for _ in keys]
        self.pending.update({key: (loop, future) for key, future in zip(keys, futures)})
        start = time.perf_counter()
        try:
            async with self.budget.hold(decoding):
                if self.pool is None:
                    width, height, prompt_tokens = await asyncio.to_thread(
                        _encode_and_send, self.encoder, self.inbox, keys, data, phrases, param, max_tokens)
                else:
                    pool = self.pool
                    try:
                        width, height, prompt_tokens = await loop.run_in_executor(
                            pool, _encode_in_worker, keys, data, phrases, param, max_tokens)
                    except BrokenProcessPool:  # a worker died (killed, out of memory): new ones for the next
                        if self.pool is pool:
                            self.pool = self._new_pool()
                            pool.shutdown(wait=False)
                        raise
        except BaseException:
            for key in keys:
                self.pending.pop(key, None)
            raise
        encoded_at = time.perf_counter()
        self.metrics.encode_seconds.observe(encoded_at - start)
        return Answer(width, height, list(await asyncio.gather(*futures)), prompt_tokens, encoded_at)

    def _read_answers(self) -> None:
        """The answers, as the model's process sends them, to their requests' futures (a thread)."""
        import queue

        while True:
            try:
                results, stats = self.outbox.get(timeout=1)
            except queue.Empty:
                if not self.process.is_alive():
                    return self._model_died()
                continue
            self.metrics.batch_size.observe(stats["size"])
            self.metrics.batch_seconds.observe(stats["seconds"])
            for wait in stats["waits"]:
                self.metrics.queue_seconds.observe(wait)
            for key, result in results:
                loop, future = self.pending.pop(key, (None, None))
                if future is not None:
                    loop.call_soon_threadsafe(_settle, future, result)

    def _model_died(self) -> None:
        if self.process.exitcode == 0:  # ended by stop()
            return
        self.died = f"the model's process exited with {self.process.exitcode}; the server stops"
        print(f"error: {self.died}", file=sys.stderr, flush=True)
        for key in list(self.pending):
            loop, future = self.pending.pop(key)
            loop.call_soon_threadsafe(_settle, future, self.died)
        if self.on_death is not None:
            self.on_death()


class DecodeBudget:
    """Bytes of decoded images in memory at once, over all requests (``--decode-budget-mb``): a
    request holds what its image's header says decoding it takes (``images.decoding_bytes``) while
    it is decoded and encoded; others wait, first come first served (a large image is not passed
    by a stream of small ones). One larger than the whole budget waits for all of it."""

    def __init__(self, total: int):
        self.total = self.free = total
        self.waiting: collections.deque = collections.deque()  # (bytes, future), in arrival order

    @contextlib.asynccontextmanager
    async def hold(self, wanted: int):
        wanted = min(wanted, self.total)
        if self.waiting or self.free < wanted:
            entry = (wanted, asyncio.get_running_loop().create_future())
            self.waiting.append(entry)
            try:
                await entry[1]
            except BaseException:  # cancelled (the server stops): its place, or what it was given, goes on
                if entry[1].done() and not entry[1].cancelled():
                    self.free += wanted
                else:
                    self.waiting.remove(entry)
                self._grant()
                raise
        else:
            self.free -= wanted
        try:
            yield
        finally:
            self.free += wanted
            self._grant()

    def _grant(self) -> None:
        while self.waiting and self.waiting[0][0] <= self.free:
            wanted, future = self.waiting.popleft()
            self.free -= wanted
            future.set_result(None)


def _settle(future, result) -> None:
    if future.done():
        return
    if isinstance(result, str):  # the model failed on this phrase's batch
        future.set_exception(RuntimeError(result))
    else:
        future.set_result(result)
