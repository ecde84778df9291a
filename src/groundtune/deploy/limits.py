"""What one request to `groundtune serve` may ask, how requests are queued and batched, and what a
connection may hold (``Limits``): each field is a flag of the command (``flag``), its default and
help read from here (cli/deploy.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from groundtune.config import InferSettings
from groundtune.data.records import MAX_PHRASE_CHARS
from groundtune.errors import ConfigError, shown

MB = 2**20  # a Limits field counted in bytes (*_bytes) is a flag in MB: max_body_bytes is --max-body-mb


def flag(name: str) -> str:
    """The `groundtune serve` flag of the Limits field ``name``."""
    return "--" + (name.removesuffix("_bytes") + "_mb" if name.endswith("_bytes") else name).replace("_", "-")


_SHARED = {f.name: f for f in fields(InferSettings)}  # the settings serve shares with eval and predict


def _limit(default, help: str, least: float | None = None):
    """A Limits field: its default, its flag's help, and the least value it takes (by default 1 for
    a count, 0.001 for a number)."""
    least = (1 if isinstance(default, int) else 0.001) if least is None else least
    return field(default=default, metadata={"help": help, "least": least})


@dataclass(frozen=True)
class Limits:
    """What one request may ask, how requests are queued and batched, and what a connection may hold
    (connections.py). Each field is a flag of `groundtune serve` (``flag``), its default and help
    read from here (cli/deploy.py)."""

    # the batch size every command that answers shares: its default and help are config.InferSettings'
    batch_size: int = _limit(InferSettings.batch_size, _SHARED["batch_size"].metadata["help"])
    max_wait_ms: float = _limit(5.0, "how long a phrase waits for others to fill its batch while the model is free "
                                     "(while it is busy, the batch fills until it is done)", least=0)
    queue_size: int = _limit(256, "phrases that may wait; beyond, 503 with Retry-After")
    workers: int | None = _limit(None, "processes decoding and encoding request images, 0: threads of the server "
                                       "(default: some on a GPU machine, none on a CPU one, where the model needs "
                                       "the cores)", least=0)  # None: infer.default_workers
    max_body_bytes: int = _limit(20 * MB, "largest request body; larger: 413")  # a big phone photo in base64
    # 60 s: a body of 20 MB arriving at 2.7 Mbit/s
    body_timeout_s: float = _limit(60.0, "a request's whole body must arrive within this; a stalled or slower one: 408")
    # 10 s: a request line and headers are a few hundred bytes; a client that takes longer is stalling
    header_timeout_s: float = _limit(10.0, "a request's line and headers must arrive within this, from when the "
                                           "connection opens (or its previous answer was sent); later: 408 and "
                                           "closed (one that sent nothing: closed)")
    # None: connections.budget, from the open-file limit
    max_connections: int | None = _limit(None, "open connections at most; a new one past it takes the place of the "
                                               "oldest that has not sent a whole request's headers, or is answered "
                                               "503 and closed when every one is busy with a request (default: "
                                               "4096, or what the open-file limit, ulimit -n, leaves room for)",
                                         least=1)
    max_image_pixels: int = _limit(50_000_000, "largest image, in pixels of the decoded frame (read from its own "
                                               "header before decoding); larger: 413")
    # 1 GB: two limit-sized 16-bit PNGs (367 MB each) or four 50 MP JPEG photos (~225 MB)
    decode_budget_bytes: int = _limit(2**30, "memory for decoding images, all requests together: each waits for "
                                             "what its image takes (a 50 MP 16-bit PNG: 367 MB; one larger than all "
                                             "of it is decoded alone)")
    max_phrases: int = _limit(16, "phrases per request")
    # the limit every file's phrases have (data/records.py), the default of the server's
    max_phrase_chars: int = _limit(MAX_PHRASE_CHARS, "longest phrase, in characters")

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), f.metadata["least"]
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= least):
                raise ConfigError(f"{flag(f.name)} must be a number of at least {least:g}, got {shown(value)}")
