"""`groundtune serve`: the real server (uvicorn on 127.0.0.1, a free port, the tiny model) answered
through both APIs, the official openai client included; boxes in the caller's original pixels
(an EXIF-rotated photo too); every caller mistake a 4xx JSON error; the API key; batching; the
bounded queue."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageOps

from groundtune import infer
from groundtune.data import synth
from groundtune.serve import launch

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _start(*flags: str):
    return launch("tiny", "--device", "cpu", *flags, timeout_s=30, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  text=True)


@pytest.fixture(scope="module")
def server():
    process, url = _start("--api-key", KEY, "--max-phrases", "3", "--max-phrase-chars", "40", "--max-body-mb", "0.5",
                          "--max-image-pixels", "300000", "--batch-size", "8", "--max-wait-ms", "20")
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def gm():
    return infer.load("tiny", device="cpu")


def _scene(width: int = 168, height: int = 168, index: int = 0) -> tuple[bytes, str]:
    image, record = synth.make_sample(seed=6, index=index, width=width, height=height, task="single")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), record["phrase"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _ground(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/v1/ground", json=body, headers=AUTH, timeout=60, **kwargs)


def test_ground_answers_as_predict_does(server, gm):
    png, phrase = _scene(200, 140)
    ours = infer.predict(gm, [Image.open(io.BytesIO(png))], [phrase])[0]
    answer = _ground(server, {"image": _b64(png), "phrase": phrase}).json()
    assert (answer["width"], answer["height"]) == (200, 140)
    (result,) = answer["results"]
    assert result["raw"] == ours.raw and result["bbox"] == ours.to_json()["bbox"] and result["bbox"] is not None
    assert set(answer["timing_ms"]) == {"decode", "model", "total"}
    # a data: URI, a list of phrases, a multipart upload: the same answer
    two = _ground(server, {"image": "data:image/png;base64," + _b64(png), "phrases": [phrase, "the big blue square"]}).json()
    assert two["results"][0]["bbox"] == result["bbox"] and len(two["results"]) == 2
    multipart = httpx.post(server + "/v1/ground", files={"image": ("a.png", png)}, data={"phrase": phrase},
                           headers=AUTH, timeout=60).json()
    assert multipart["results"][0]["bbox"] == result["bbox"]


def test_an_exif_rotated_photo_gets_boxes_in_its_shown_pixels(server, gm):
    """A camera JPEG stored 240x160 with EXIF orientation 6 is shown 160x240: the box is in those
    pixels, as groundtune's own predict gives it on the image a viewer shows."""
    image, record = synth.make_sample(seed=7, index=0, width=240, height=160, task="single")
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95, exif=exif)
    jpeg = buffer.getvalue()
    shown = ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg)))
    assert shown.size == (160, 240)
    ours = infer.predict(gm, [shown.convert("RGB")], [record["phrase"]])[0]
    answer = _ground(server, {"image": _b64(jpeg), "phrase": record["phrase"]}).json()
    assert (answer["width"], answer["height"]) == (160, 240)
    assert answer["results"][0]["raw"] == ours.raw and answer["results"][0]["bbox"] == ours.to_json()["bbox"]


def test_the_openai_client_works_unchanged(server, gm):
    openai = pytest.importorskip("openai")
    png, phrase = _scene(index=2)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY)
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
        {"type": "text", "text": phrase}]}])
    ours = infer.predict(gm, [Image.open(io.BytesIO(png))], [phrase])[0]
    assert response.choices[0].message.content == ours.raw
    extra = response.model_extra["groundtune"]
    assert extra["bbox"] == ours.to_json()["bbox"] and (extra["width"], extra["height"]) == (168, 168)
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong").models.list()


@pytest.mark.parametrize("body, status, says", [
    ({"phrase": "x"}, 422, "missing 'image'"),
    ({"image": "IMAGE", "phrase": "a", "phrases": ["b"]}, 422, "exactly one"),
    ({"image": "IMAGE", "phrases": ["a", "b", "c", "d"]}, 422, "--max-phrases"),
    ({"image": "IMAGE", "phrase": "x" * 41}, 422, "--max-phrase-chars"),
    ({"image": "IMAGE", "phrase": "  "}, 422, "non-empty"),
    ({"image": "IMAGE", "phrases": "not a list but fine"}, 200, None),
    ({"image": "https://example.com/cat.jpg", "phrase": "x"}, 422, "does not fetch"),
    ({"image": "/etc/passwd", "phrase": "x"}, 422, "does not read files"),
    ({"image": "../secret.png", "phrase": "x"}, 422, "does not read files"),
    ({"image": "not base64!", "phrase": "x"}, 422, "not valid base64"),
    ({"image": _b64(b"GIF89a garbage that is no image"), "phrase": "x"}, 422, "cannot be decoded"),
    ({"image": _b64(b"no image format at all"), "phrase": "x"}, 422,
     "the image cannot be decoded (not an image format the server reads)"),
    ({"image": "BIG", "phrase": "x"}, 413, "--max-image-pixels"),
    ({"image": "THIN", "phrase": "x"}, 422, "aspect ratio"),
    ({"image": "data:image/png,rawbytes", "phrase": "x"}, 422, "must be base64"),
])
def test_caller_mistakes_are_4xx_json_errors(server, body, status, says):
    png, _ = _scene()
    big = io.BytesIO()
    Image.new("RGB", (700, 500)).save(big, format="PNG")  # 350,000 pixels, a small file
    thin = io.BytesIO()
    Image.new("RGB", (1000, 4)).save(thin, format="PNG")  # a ratio of 250: Qwen-VL's resize refuses it
    images = {"IMAGE": _b64(png), "BIG": _b64(big.getvalue()), "THIN": _b64(thin.getvalue())}
    body = {k: images.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    response = _ground(server, body)
    assert response.status_code == status, response.text
    if says:
        assert says in response.json()["error"]["message"]


def test_requests_that_are_not_grounding_requests(server):
    png, _ = _scene()
    def post(path, headers=None, **kwargs):
        return httpx.post(server + path, headers={**AUTH, **(headers or {})}, timeout=30, **kwargs)

    assert post("/v1/ground", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    assert post("/v1/ground", json=[1, 2]).status_code == 422
    too_big = post("/v1/ground", json={"image": "A" * 600_000, "phrase": "x"})
    assert too_big.status_code == 413 and "--max-body-mb" in too_big.json()["error"]["message"]
    chunked = post("/v1/ground", content=iter([b'{"image": "' + b"A" * 300_000, b"A" * 300_000 + b'"}']))
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    assert post("/v1/ground", files={"photo": ("a.png", png)}, data={"phrase": "x"}).status_code == 422
    chat = {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, {"type": "text", "text": "x"}]}]}
    assert "data: URI" in post("/v1/chat/completions", json=chat).json()["error"]["message"]
    assert post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).status_code == 422
    assert post("/v1/chat/completions", json={"model": "tiny", "stream": True, "messages": []}).status_code == 422
    missing = httpx.get(server + "/v1/nothing", headers=AUTH)
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.post(server + "/v1/ground", json={"image": _b64(png), "phrase": "x"}).status_code == 401
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/health").json()["status"] == "ok"  # and the server is still up
    page = httpx.get(server + "/")
    assert page.status_code == 200 and "/v1/ground" in page.text
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    assert 'groundtune_requests_total{endpoint="/v1/ground",status="413"}' in metrics
    assert 'status="500"' not in metrics


def test_concurrent_requests_are_answered_in_batches(server):
    requests = [_scene(index=i) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda r: _ground(server, {"image": _b64(r[0]), "phrase": r[1]}), requests))
    assert [a.status_code for a in answers] == [200] * 16
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    count = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("groundtune_batch_size_count")))
    total = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("groundtune_batch_size_sum")))
    assert total / count > 1.5  # phrases per model call, over every request this server answered


def test_served_with_no_flags_as_the_readme_says():
    """`groundtune serve --model M` alone: the device and the encoding workers chosen for the machine."""
    process, url = launch("tiny", timeout_s=30, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        png, phrase = _scene()
        answer = httpx.post(url + "/v1/ground", json={"image": _b64(png), "phrase": phrase}, timeout=60)
        assert answer.status_code == 200 and answer.json()["results"][0]["raw"]
        assert httpx.get(url + "/health").json()["family"] == "qwen2.5-vl"
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_encoding_processes_answer_as_the_server_does_alone(gm):
    """--workers N (a GPU machine's default): images decoded and prompts encoded in processes of
    their own; the same boxes, and a caller's mistake found there is still its 4xx."""
    process, url = _start("--workers", "2", "--max-image-pixels", "300000")
    try:
        png, phrase = _scene(200, 140)
        ours = infer.predict(gm, [Image.open(io.BytesIO(png))], [phrase])[0]
        answer = httpx.post(url + "/v1/ground", json={"image": _b64(png), "phrases": [phrase, phrase]}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert [r["bbox"] for r in answer.json()["results"]] == [ours.to_json()["bbox"]] * 2
        big, thin = io.BytesIO(), io.BytesIO()
        Image.new("RGB", (700, 500)).save(big, format="PNG")
        Image.new("RGB", (1000, 4)).save(thin, format="PNG")
        for image, status, says in [(b"GIF89a no image", 422, "cannot be decoded"),
                                    (big.getvalue(), 413, "--max-image-pixels"), (thin.getvalue(), 422, "aspect ratio")]:
            refused = httpx.post(url + "/v1/ground", json={"image": _b64(image), "phrase": "x"}, timeout=60)
            assert refused.status_code == status and says in refused.json()["error"]["message"], refused.text
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={"model": "tiny", "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}},
                                        {"type": "text", "text": phrase}]}]})
        assert chat.json()["groundtune"]["bbox"] == ours.to_json()["bbox"]
        workers = _children(process.pid)
        assert len(workers) >= 3  # the model's process and two encoding workers
    finally:
        process.terminate()
        process.wait(timeout=20)
    # stopped by SIGTERM as systemd stops it: a normal exit, nothing said, nothing left behind
    output = process.stdout.read()
    assert process.returncode == 0 and "Traceback" not in output and "leaked" not in output, output
    deadline = time.monotonic() + 10
    while [pid for pid in workers if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]  # the workers ended with the server


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux: /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def test_a_full_queue_answers_503_with_retry_after():
    process, url = _start("--queue-size", "2", "--batch-size", "1", "--max-wait-ms", "0")
    try:
        png, phrase = _scene()
        body = {"image": _b64(png), "phrase": phrase}
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/ground", json=body, timeout=60), range(24)))
        statuses = [a.status_code for a in answers]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2
        busy = next(a for a in answers if a.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_taken_port_is_one_line_and_exit_2():
    import socket
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "groundtune", "serve", "--model", "tiny", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in "
                                   "use); choose another --port (or --host)")
    assert "serving" not in done.stdout  # said before the model loads, not after


def test_a_model_that_cannot_load_is_said_with_exit_2(tmp_path):
    import socket
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "groundtune", "serve", "--model", str(tmp_path / "nothing"),
                           "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and str(tmp_path / "nothing") in done.stderr and "Traceback" not in done.stderr


def test_the_server_stops_when_its_model_process_dies():
    """The model answers in a process of its own; killed (out of memory, say), the waiting request
    gets a 500 and the server exits 1 saying why, for a supervisor to restart it."""
    import signal

    process, url = _start()
    try:
        (model,) = [pid for pid in _children(process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        png, phrase = _scene()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, url + "/v1/ground", json={"image": _b64(png), "phrase": phrase},
                                  timeout=60)
            os.kill(model, signal.SIGKILL)
            answer = waiting.result()
        assert answer.status_code in (200, 500)  # answered before the kill, or failed by it
        assert process.wait(timeout=30) == 1
        assert "the model's process exited with -9; the server stops" in process.stdout.read()
    finally:
        process.kill()
