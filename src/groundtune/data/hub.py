"""``hf:REPO:SPLIT``: a RefCOCO-style data set of the Hugging Face Hub, read as canonical records.

    groundtune eval --model runs/sft --data hf:lmms-lab/RefCOCO:val
    groundtune train qwen2.5-vl-3b-lora-24gb train_data=hf:lmms-lab/RefCOCOg:val
    groundtune data check hf:lmms-lab/RefCOCOplus:testA

``records.jsonl_file`` hands every ``hf:`` data path to ``local_jsonl``, so each command that
reads data takes one. SPLIT may be left out when the repo has a single split.

The repo is read by the ``datasets`` library (an optional extra: ``groundtune[hf]``): it downloads
the parquet files into the hub cache and prepares its arrow copy as it always does. Its rows are
turned into records by ``sources.parquet_samples``, the converter of ``data convert --from
parquet``, and the records with their images are kept in
``$GROUNDTUNE_CACHE/hf-v1/ORG--NAME/COMMIT/SPLIT`` (default ~/.cache/groundtune): only the first
run converts. Image paths in that JSONL are absolute, so the records read the same wherever the
command that holds ``hf:...`` resolves them.

Which commit: the hub's newest, asked with one request. Offline (``HF_HUB_OFFLINE=1`` or
``HF_DATASETS_OFFLINE=1``), or when the hub cannot be reached, the snapshot the hub cache holds
(``refs/main``: what an earlier run or ``hf download REPO --repo-type dataset`` left), read by
``datasets`` as a local folder: offline, ``datasets`` 5 looks a repo id up only in its own arrow
cache, which a download by the hub's client never fills. With neither, the newest converted copy
here is used, and without that the command stops, saying how to get one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from groundtune.errors import DataError, MissingPackageError
from groundtune.files import cache_dir

from . import sources
from .records import write_samples

PREFIX = "hf:"  # groundtune.data registers it as a literal: importing this module costs pyarrow
RECORDS = "records.jsonl"
_ONE_SPLIT = "_"  # the cache folder of ``hf:REPO``, the split left to the repo's only one
_TRUE = ("1", "ON", "YES", "TRUE")

_resolved: dict[str, Path] = {}  # spec -> its JSONL: a command asks more than once (check, then read)


def parse(spec: str) -> tuple[str, str | None]:
    """``hf:ORG/NAME:SPLIT`` -> (repo, split); split None when not given."""
    repo, colon, split = spec[len(PREFIX):].partition(":")
    parts = repo.split("/")
    if not repo or len(parts) > 2 or not all(parts) or ":" in split or (colon and not split):
        raise DataError(f"{spec}: not a hub data set; write hf:ORG/NAME:SPLIT, e.g. hf:lmms-lab/RefCOCO:val")
    return repo, split or None


def cache_root() -> Path:
    # hf-v1: bump when the records written for a row change, so no run reads the old ones
    return cache_dir() / "hf-v1"


def local_jsonl(spec: str) -> Path:
    """The canonical JSONL of ``hf:REPO[:SPLIT]``, converted on the first call for that commit."""
    spec = str(spec)
    if spec not in _resolved:
        _resolved[spec] = _local_jsonl(spec)
    return _resolved[spec]


def _local_jsonl(spec: str) -> Path:
    repo, split = parse(spec)
    commit, snapshot = _commit(repo)
    if commit is None:
        return _converted_copy(spec, repo, split)
    folder = cache_root() / repo.replace("/", "--") / commit / (split or _ONE_SPLIT)
    if _complete(folder):
        return folder / RECORDS
    _convert(_import_datasets(spec), spec, repo, split, commit, snapshot, folder)  # 2 s to import: only here
    return folder / RECORDS


def _import_datasets(spec: str):
    try:
        import datasets
    except ImportError:
        raise MissingPackageError(f'{spec} is read with the datasets library: pip install "groundtune[hf]"') from None
    return datasets


def _offline() -> bool:
    """What the user set, read now: huggingface_hub and datasets read it once, on import."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or any(os.environ.get(v, "").upper() in _TRUE
                                           for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _commit(repo: str) -> tuple[str | None, Path | None]:
    """(commit, snapshot folder): the hub's newest commit when it answers (no folder: ``datasets``
    downloads the repo), else the hub cache's ``refs/main`` and its snapshot; (None, None) when
    neither is there."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.utils import httpx  # the HTTP library the hub's client uses (httpx, or httpx2 from 2.x)

    if not _offline():
        try:
            return HfApi().dataset_info(repo, timeout=20).sha, None
        except GatedRepoError:
            raise DataError(f"hf:{repo} is gated: accept its terms on https://huggingface.co/datasets/{repo} and "
                            "log in with `hf auth login`") from None
        except RepositoryNotFoundError:
            raise DataError(f"hf:{repo}: no such dataset on the Hugging Face Hub (or a private one: log in with "
                            "`hf auth login`)") from None
        except (httpx.HTTPError, HfHubHTTPError, OSError):
            pass  # the hub cannot be reached: what the cache holds
    try:
        snapshot = Path(snapshot_download(repo, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None, None
    return snapshot.name, snapshot


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion whose images are where its records say: a
    moved cache is converted again rather than read with paths that name nothing."""
    records = folder / RECORDS  # written last, atomically: there means finished
    if not records.is_file():
        return False
    with open(records, encoding="utf-8") as f:
        first = f.readline()
    return not first or Path(json.loads(first)["image"]).is_file()


def _converted_copy(spec: str, repo: str, split: str | None) -> Path:
    """Neither the hub nor its cache: the newest copy converted here, or the one line saying how
    to get one."""
    copies = [f for f in (cache_root() / repo.replace("/", "--")).glob(f"*/{split or _ONE_SPLIT}") if _complete(f)]
    if copies:
        return max(copies, key=lambda f: (f / RECORDS).stat().st_mtime) / RECORDS
    raise DataError(f"{spec} is not in the local cache and the hub cannot be reached: run once with network, "
                    f"or `hf download {repo} --repo-type dataset`")


def _convert(datasets, spec: str, repo: str, split: str | None, commit: str, snapshot: Path | None,
             folder: Path) -> None:
    """Load the split with ``datasets`` and write its records and images into ``folder``."""
    where = f"hf:{repo}"
    try:
        # A snapshot is read as a local folder (its README's splits and features included). Online,
        # the repo at "main", not at ``commit``: so the hub cache records refs/main, which an offline
        # run reads (a push between the two requests is converted again by the next run).
        builder = datasets.load_dataset_builder(str(snapshot) if snapshot is not None else repo)
    except (FileNotFoundError, ConnectionError, ValueError) as e:
        raise DataError(f"{spec}: the datasets library cannot read it ({e})") from None
    splits = list(builder.config.data_files or {})
    if not splits:
        raise DataError(f"{spec}: {repo} holds no data file the datasets library can read")
    if split is None and len(splits) != 1:
        raise DataError(f"{spec}: {repo} has the splits {', '.join(splits)}; name one, e.g. {where}:{splits[0]}")
    if split is not None and split not in splits:
        raise DataError(f"{spec}: no split {split!r}; {repo} has the splits {', '.join(splits)}")
    split = split or splits[0]
    if builder.info.features is not None:  # known from the README: refuse before downloading
        sources.parquet_columns(builder.info.features, where)
    print(f"{spec}: converting commit {commit[:12]} once into {folder}", file=sys.stderr)
    # datasets prepares every split of the repo (its way), then the one asked for is read
    builder.download_and_prepare()
    dataset = builder.as_dataset(split=split)
    columns = sources.parquet_columns(dataset.column_names, where)
    # memory-mapped arrow, sliced into batches of 64 rows as the parquet reader does; a freshly
    # loaded Dataset has no indices mapping, so its table is its rows in order
    batches = dataset.data.table.select(columns).to_batches(max_chunksize=64)
    rows = sources.RowBatches(f"hf:{repo}:{split}", split, batches)
    write_samples(folder / RECORDS, sources.parquet_samples([rows], folder / "images", None, split, len(dataset)))
