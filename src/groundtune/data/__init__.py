"""Data: sources -> canonical JSONL, checks, pictures, the synthetic set, box-true augmentation.

Every data path becomes a file in ``records.jsonl_file``; a hub data set (``hf:REPO:SPLIT``) is
made one by data/hub.py, registered here, above both: hub writes through records, so records
cannot import it without an import circle."""

from __future__ import annotations

from pathlib import Path

from groundtune.data import records


def _hub_jsonl(spec: str) -> Path:
    # here, not at the top: datasets, pyarrow and the hub's client load only for an hf: path
    from groundtune.data import hub

    return hub.local_jsonl(spec)


records.REMOTE_DATA["hf:"] = _hub_jsonl
