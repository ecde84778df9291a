"""The hub push of an export (``groundtune export RUN --out DIR --push-to-hub REPO``): the repo id
and the token checked before the export (``check_hub``), then every file of the folder uploaded
through huggingface_hub's own API (``push_to_hub``). tests/test_hub_push.py pushes to a stand-in of
the hub's HTTP API on 127.0.0.1."""

from __future__ import annotations

import shlex
from pathlib import Path

from groundtune.errors import GroundtuneError, UsageError


def check_hub(repo_id: str) -> None:
    """What ``push_to_hub`` needs, checked before an export's minutes are spent: a repo id that
    huggingface_hub's own validator takes (``name`` or ``owner/name``), the hub not switched off,
    and a token, found as huggingface_hub finds it (HF_TOKEN, then the saved login)."""
    from huggingface_hub import get_token, is_offline_mode
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        why = str(e).replace(" Use `repo_type` argument if needed.", "")  # advice to Python callers
        raise UsageError(f"--push-to-hub {repo_id!r}: not a repo id (name or owner/name): {why}") from None
    if is_offline_mode():
        raise UsageError("--push-to-hub: HF_HUB_OFFLINE is set, so the hub cannot be reached; unset it to push")
    if get_token() is None:
        raise UsageError("--push-to-hub: no Hugging Face token found; log in with `hf auth login` (`huggingface-cli "
                         "login` before huggingface_hub 1.0) or set HF_TOKEN to a token with write access")


def push_to_hub(folder: Path, repo_id: str, private: bool = False, revision: str | None = None,
                commit_message: str | None = None, say=print) -> str:
    """Upload every file of the export ``folder`` to the model repo ``repo_id`` on branch
    ``revision`` (main by default; made from main where it is not there) in one call of
    huggingface_hub's ``upload_folder``; returns the repo's URL. A new repo is private with
    ``private``, else as the owner's hub settings make new repos; an existing public repo is
    refused with ``private`` rather than given the weights. Files the repo already holds that this
    export has not are left there. The hub's refusals and network failures raise one line that
    names the repo and the folder, which stays on disk."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    api = HfApi()
    try:
        url = str(api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True))
        if private and not api.repo_info(repo_id, repo_type="model").private:
            raise GroundtuneError(f"--push-to-hub {repo_id} --private: the repo exists and is public, and pushing "
                                  "does not change that; make it private on the hub, or push without --private "
                                  f"(the export is in {folder})")
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                          commit_message=commit_message or f"Upload {folder.name}, exported by groundtune")
    except _hub_errors() as e:
        again = f"hf upload {repo_id} {shlex.quote(str(folder))} ." + (
            f" --revision {shlex.quote(revision)}" if revision else "")
        raise GroundtuneError(f"--push-to-hub {repo_id}: {_hub_failure(e, api.endpoint)}; the export stays in "
                              f"{folder} (upload it again with `{again}`)") from e
    files = sum(1 for p in folder.rglob("*") if p.is_file())
    say(f"pushed the {files} files of {folder} to {repo_id}" + (f" (branch {revision})" if revision else ""))
    return url


def _hub_errors() -> tuple[type[BaseException], ...]:
    """The errors of a push that say the hub refused it or could not be reached. A refused
    connection or a timeout comes as the hub client's HTTP library's own error, unwrapped (httpx
    in huggingface_hub 1, httpx2 in 2: the one it exports, as data/hub.py reads it)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    from huggingface_hub.utils import httpx

    return HfHubHTTPError, httpx.HTTPError, OfflineModeIsEnabled


def _hub_failure(error: BaseException, endpoint: str) -> str:
    """One line on why a push failed: the hub's own message where it sent one (a bad token, no
    right to the namespace), else the client's."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError) and error.server_message:
        why = f"the hub answered {error.response.status_code}: {error.server_message}"
    elif isinstance(error, HfHubHTTPError):
        why = str(error).splitlines()[0]
    else:
        why = f"cannot reach {endpoint} ({error})"
    return " ".join(why.split())
