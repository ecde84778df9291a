"""`groundtune export RUN --out OUT --push-to-hub REPO`: every file of the export reaches the repo,
through huggingface_hub's own client, pushed to a stand-in of the hub's HTTP API on 127.0.0.1
(HF_ENDPOINT); what cannot be pushed (no token, a bad repo id) is refused before the export starts,
and what the hub refuses or cannot be reached is one line naming the repo and the folder left on
disk. Two cases are real processes: the console entry point pushing through HF_ENDPOINT, and the
missing token (huggingface_hub reads HF_HOME once, at import); the rest call `main()` here."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub
import pytest
import yaml
from test_export import _run_with_lora

from groundtune.cli import main

TOKEN = "hf_stand_in_token"


class Hub:
    """The endpoints huggingface_hub's create_repo, repo_info, create_branch and upload_folder
    call, as the installed version calls them. Its preupload answer makes every file a regular one,
    sent base64 in the commit itself, so no LFS or xet storage is stood in for (the real hub sends
    weights there; the client's path up to that answer, and the commit, are the same)."""

    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo id -> {"private", "branches": {name: {path: bytes}}}
        self.commits: list[dict] = []  # {"repo", "revision", "summary", "files"}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, authorization
        self.refuse_commits = False
        self.unknown: list[str] = []  # what it was asked and does not stand in for
        self.card_metadata: dict | None = None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # the test's output, not the server's
                pass

            def do_GET(self):
                hub.requests.append((self.command, self.path, self.headers.get("authorization")))
                parts = self.path.split("?")[0].strip("/").split("/")  # api models OWNER NAME
                repo = hub.repos.get("/".join(parts[2:4]))
                if parts[:2] != ["api", "models"] or repo is None:
                    return self.answer(404, {"error": "Repository not found"})
                self.answer(200, {"id": "/".join(parts[2:4]), "private": repo["private"], "sha": "0" * 40})

            def do_POST(self):
                hub.requests.append((self.command, self.path, self.headers.get("authorization")))
                body = self.rfile.read(int(self.headers["content-length"]))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "validate-yaml"]:  # the model card's metadata, checked before the upload
                    card = json.loads(body)["content"]
                    hub.card_metadata = yaml.safe_load(card.split("---\n")[1])
                    return self.answer(200, {"errors": [], "warnings": []})
                if parts == ["api", "repos", "create"]:
                    asked = json.loads(body)
                    repo_id = f"{asked['organization']}/{asked['name']}"
                    if repo_id in hub.repos:
                        return self.answer(409, {"error": "You already created this model repo",
                                                 "url": f"{hub.endpoint}/{repo_id}"})
                    assert asked["type"] == "model"
                    hub.repos[repo_id] = {"private": asked.get("visibility") == "private",
                                          "branches": {"main": {".gitattributes": b"*.safetensors filter=lfs\n"}}}
                    return self.answer(200, {"url": f"{hub.endpoint}/{repo_id}"})
                if parts[:2] != ["api", "models"] or len(parts) < 6 or "/".join(parts[2:4]) not in hub.repos:
                    hub.unknown.append(self.path)
                    return self.answer(404, {"error": f"the stand-in has no {self.path}"})
                repo_id, action, revision = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                branches = hub.repos[repo_id]["branches"]
                if action == "branch":
                    if revision in branches:
                        return self.answer(409, {"error": "Branch already exists"})
                    branches[revision] = dict(branches["main"])
                    return self.answer(200, {})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self.answer(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False, "oid": None} for f in files]})
                assert action == "commit" and self.headers["content-type"] == "application/x-ndjson"
                if hub.refuse_commits:
                    return self.answer(403, {"error": "You don't have the rights to push to this repo"})
                lines = [json.loads(line) for line in body.splitlines()]
                files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                         for line in lines if line["key"] == "file"}
                assert {line["key"] for line in lines} == {"header", "file"}
                branches[revision].update(files)
                hub.commits.append({"repo": repo_id, "revision": revision, "files": files,
                                    "summary": lines[0]["value"]["summary"]})
                self.answer(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{len(hub.commits):040x}",
                                  "commitOid": f"{len(hub.commits):040x}"})

            def answer(self, status: int, payload: dict):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in, which huggingface_hub in this process and in the CLI's subprocesses talks
    to, with a token in HF_TOKEN and no saved login (HF_HOME is empty)."""
    stand_in = Hub()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", stand_in.endpoint)  # read at import
    monkeypatch.setenv("HF_ENDPOINT", stand_in.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield stand_in
    stand_in.server.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_model):
    """A LoRA run on the small random model, with an eval result its model card shows."""
    return _run_with_lora(small_model, tmp_path_factory.mktemp("hub") / "run")


def _groundtune(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "groundtune", *args], check=False, capture_output=True, text=True,
                          env=env, timeout=300)


def _error_line(stderr: str) -> str:
    """The error the command ended with, which must be one line, and its last."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr
    return errors[0]


def test_every_file_of_the_export_reaches_the_repo(hub, run, tmp_path):
    out = tmp_path / "export"
    done = _groundtune("export", str(run), "--out", str(out), "--push-to-hub", "me/grounding", "--private",
                       "--revision", "v1", "--commit-message", "the first grounding model")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{hub.endpoint}/me/grounding"  # the repo's URL, alone on stdout
    repo = hub.repos["me/grounding"]
    assert repo["private"] is True
    [commit] = hub.commits
    assert commit["revision"] == "v1" and commit["summary"] == "the first grounding model"
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert commit["files"] == written  # every file, byte for byte
    assert sorted(written) == json.loads((out / "groundtune.json").read_text())["files"]
    assert {"README.md", "groundtune.json", "config.json", "model.safetensors", "generation_config.json",
            "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(written)
    assert "Acc@0.5 **0.500**" in commit["files"]["README.md"].decode()  # the run's model card
    assert repo["branches"]["v1"] == {".gitattributes": b"*.safetensors filter=lfs\n", **written}
    assert list(repo["branches"]["main"]) == [".gitattributes"]  # the branch only
    repo_requests = [r for r in hub.requests if r[1].startswith(("/api/repos/", "/api/models/"))]
    assert [method for method, _, _ in repo_requests] == ["POST", "GET", "POST", "POST", "POST"]
    assert {authorization for _, _, authorization in repo_requests} == {f"Bearer {TOKEN}"} and not hub.unknown
    assert hub.card_metadata["library_name"] == "transformers" and "visual-grounding" in hub.card_metadata["tags"]
    assert "pushed the" in done.stderr and "(branch v1)" in done.stderr


def test_a_second_push_goes_to_the_existing_repo_and_main(hub, run, tmp_path, capsys):
    hub.repos["me/grounding"] = {"private": False, "branches": {"main": {"README.md": b"old card"}}}
    assert main(["export", str(run), "--out", str(tmp_path / "export"), "--push-to-hub", "me/grounding"]) == 0
    assert capsys.readouterr().out.strip() == f"{hub.endpoint}/me/grounding"
    [commit] = hub.commits
    assert commit["revision"] == "main" and commit["summary"] == "Upload export, exported by groundtune"
    assert hub.repos["me/grounding"]["branches"]["main"]["README.md"] != b"old card"
    assert hub.repos["me/grounding"]["private"] is False
    # --private never hands the weights to an existing public repo
    assert main(["export", str(run), "--out", str(tmp_path / "again"), "--push-to-hub", "me/grounding",
                 "--private"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "me/grounding --private: the repo exists and is public" in line and str(tmp_path / "again") in line
    assert len(hub.commits) == 1


def test_what_the_hub_refuses_is_one_line_and_the_export_stays(hub, run, tmp_path, capsys):
    hub.refuse_commits = True
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--push-to-hub", "me/grounding"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith("error: --push-to-hub me/grounding: the hub answered 403: You don't have the rights")
    assert f"the export stays in {out}" in line and f"hf upload me/grounding {out} ." in line
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    # and a hub that cannot be reached (nothing listens on the port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    huggingface_hub.constants.ENDPOINT = closed  # the fixture's monkeypatch puts it back
    assert main(["export", str(run), "--out", str(tmp_path / "offline"), "--push-to-hub", "me/grounding",
                 "--revision", "v2"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith(f"error: --push-to-hub me/grounding: cannot reach {closed} (") and "--revision v2" in line
    assert f"the export stays in {tmp_path / 'offline'}" in line and (tmp_path / "offline" / "config.json").is_file()


def test_no_token_is_refused_before_the_export(run, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HF_OIDC_RESOURCE")}
    (tmp_path / "hf_home").mkdir()
    env["HF_HOME"] = str(tmp_path / "hf_home")  # no saved login there
    done = _groundtune("export", str(run), "--out", str(tmp_path / "export"), "--push-to-hub", "me/grounding",
                       env=env)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]  # one line, and nothing merged or written first
    assert "no Hugging Face token" in done.stderr and "hf auth login" in done.stderr and "HF_TOKEN" in done.stderr
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("repo_id", ["a/b/c", "bad..name", "me/grounding-", "with space", ""])
def test_a_bad_repo_id_is_refused_before_the_export(hub, run, tmp_path, capsys, repo_id):
    assert main(["export", str(run), "--out", str(tmp_path / "export"), "--push-to-hub", repo_id]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [_error_line(err)] and f"--push-to-hub {repo_id!r}: not a repo id" in err
    assert not (tmp_path / "export").exists() and not hub.repos


def test_hub_flags_need_a_push(run, tmp_path, capsys):
    assert main(["export", str(run), "--out", str(tmp_path / "export"), "--private", "--revision", "v1"]) == 2
    assert "--private, --revision: for a push, which needs --push-to-hub REPO" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()
