"""How fast an image's pixels reach the server's model process: through the queue's pipe, or in a
shared-memory block (``deploy/batching.py``: ``_to_wire`` on the encoding side, ``_received`` on
the model's). Encoding processes put prompts of a 3B photo's size (~1,600 patches: ~3.8 MB of
bf16 pixels) into one multiprocessing queue; the receiving process reads them on a thread, as the
model's process does, while its main thread is idle or keeps the interpreter busy (pure Python,
as a decode loop's kernel launches do).

    python bench/serve_transport.py --out bench/results/serve_transport.json   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time
from pathlib import Path

from provenance import stamped

from groundtune.cli.flags import positive_int

PATCHES, PATCH_VALUES = 1600, 1176  # a 640 x 480 photo at the 3B's budget: ~1,600 patches of 14 x 14 x 3 x 2


def _encode(inbox, items: int, shared: bool) -> None:
    import torch

    from groundtune.deploy import batching

    if not shared:
        batching.SHARED_FROM_BYTES = float("inf")
    prompt = {"pixel_values": torch.randn(PATCHES, PATCH_VALUES).to(torch.bfloat16),
              "input_ids": torch.arange(400), "image_grid_thw": torch.tensor([[1, 40, 40]])}
    for key in range(items):
        inbox.put((key, batching._to_wire(prompt)))


def _receive(inbox, items: int, busy: bool, out) -> None:
    from groundtune.deploy import batching

    first = []

    def read() -> None:  # timed from the first item: the senders' start (importing torch) is not the pipe's
        for _ in range(items):
            batching._from_wire(batching._received(inbox.get())[1])
            if not first:
                first.append(time.perf_counter())

    reader = threading.Thread(target=read)
    reader.start()
    while reader.is_alive():
        if busy:  # Python bytecode, as the model's thread runs between kernel launches
            total = 0
            for i in range(20_000):
                total += i
        else:
            reader.join(0.001)
    out.put((items - 1) / (time.perf_counter() - first[0]))


def measure(shared: bool, busy: bool, items: int, senders: int) -> float:
    context = multiprocessing.get_context("spawn")
    inbox, out = context.Queue(), context.Queue()
    receiver = context.Process(target=_receive, args=(inbox, items * senders, busy, out))
    receiver.start()
    encoders = [context.Process(target=_encode, args=(inbox, items, shared)) for _ in range(senders)]
    for p in encoders:
        p.start()
    rate = out.get()
    for p in (*encoders, receiver):
        p.join()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=positive_int, default=60, help="prompts each encoding process sends")
    parser.add_argument("--senders", type=positive_int, default=2, help="encoding processes")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.items * args.senders < 2:
        parser.error("--items x --senders: at least 2 (the rate is timed from the first item to the last)")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: its folder does not exist")
    rows = []
    for busy in (False, True):
        for shared in (False, True):
            rate = measure(shared, busy, args.items, args.senders)
            rows.append({"transport": "shared memory" if shared else "pipe", "receiver": "busy" if busy else "idle",
                         "items": args.items * args.senders, "megabytes_each": round(PATCHES * PATCH_VALUES * 2 / 1e6, 2),
                         "items_per_s": round(rate, 1)})
            print(json.dumps(rows[-1]), flush=True)
    for busy in ("idle", "busy"):
        pipe, shared = (next(r["items_per_s"] for r in rows if r["receiver"] == busy and r["transport"] == t)
                        for t in ("pipe", "shared memory"))
        print(f"receiver {busy}: shared memory {shared:.0f} items/s, pipe {pipe:.0f}: {shared / pipe:.1f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(stamped(rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
