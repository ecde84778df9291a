"""`groundtune studio`: each tab driven in a real headless Chromium against a real studio on
127.0.0.1 (a run of a small random model; the tiny model where an answer is judged), and its
refusals checked in this process.

Processes, and why: the studio itself (its start to first page is a target, and a browser needs a
server to talk to), one Chromium (the page's JavaScript is what is tested), and what the studio
starts because a terminal would (a `groundtune train` stopped from the page's button, a `groundtune
eval`, a `data check`); one `groundtune --help` interpreter to see what it imports. One studio and
one browser serve the whole module; the run is tiny (batch 2 of 112-pixel scenes, stopped after its
first evals). The refusals (paths outside the work folder, a malformed file, a folder that is not a
run, the token and Host guards) go through the app in this process.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from groundtune.data import synth

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_chromium = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
WAIT_S = 120  # for what a process of the studio's does (a model load, a run's first steps, an eval)


# --------------------------------------------------------------------------------------------
# the work folder, the studio, the browser


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, small_model) -> Path:
    """Data of each kind (sets and no target for the grid, single shapes to evaluate), a malformed
    file, a folder that is not a run, a link out of the folder, and the small model to train (a
    model's folder is held to the work folder too)."""
    work = tmp_path_factory.mktemp("studio")
    shutil.copytree(small_model, work / "small_model")
    synth.make_synthetic_set(work / "data", n=12, seed=1, task="every", workers=1)
    # the quickstart's variant (canvases the tiny model has not seen): answers right and wrong to sort
    synth.make_synthetic_set(work / "data", n=6, seed=2, task="full", split="val", width=168, height=168, workers=1)
    image, _ = synth.make_sample(seed=3, index=0, task="single")  # one shape: something to find
    image.save(work / "shape.png")
    (work / "data" / "bad.jsonl").write_text("this is not JSON\n{\"id\": 1\n[1, 2]\n")
    (work / "notarun").mkdir()
    (work / "notarun" / "notes.txt").write_text("a folder of the user's\n")
    outside = tmp_path_factory.mktemp("outside") / "secret.jsonl"
    outside.write_text((work / "data" / "val.jsonl").read_text())
    (work / "data" / "link.jsonl").symlink_to(outside)
    return work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def studio(workdir):
    """A real `groundtune studio --workdir W` on 127.0.0.1; (url, seconds from start to first page)."""
    import urllib.request

    port = _free_port()
    with open(workdir.parent / "studio.log", "wb") as log:
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "groundtune", "studio", "--workdir", str(workdir),
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1) as page:
                    assert b"groundtune studio" in page.read()
                break
            except OSError:
                assert process.poll() is None and time.perf_counter() - start < 60, \
                    (workdir.parent / "studio.log").read_text()
                time.sleep(0.05)
        yield url, time.perf_counter() - start
        process.terminate()  # the studio sends SIGTERM to what it started, and waits for it
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def page(studio, browser):
    browser.get(studio[0])
    return browser


def _wait(driver, condition, what: str, timeout: float = WAIT_S):
    """``condition(driver)`` once it is truthy; the page's message line in the failure. An element
    the page redraws between finding and reading it (Watch redraws as it polls) is looked for again."""
    from selenium.common.exceptions import (
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2,
                             ignored_exceptions=(StaleElementReferenceException,)).until(condition)
    except TimeoutException:
        raise AssertionError(f"waited {timeout} s for {what}; the page says: "
                             f"{driver.find_element('id', 'message').text!r}") from None


def _js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def _tab(driver, name: str) -> None:
    _js(driver, f"document.querySelector('nav button[data-tab={name}]').click()")


def _message(driver) -> str:
    return driver.find_element("id", "message").text


def _screenshot(driver, folder: Path, name: str) -> Path:
    """A screenshot, held to showing something: not one colour, and more than a little of it not
    the page's background."""
    path = folder / f"{name}.png"
    driver.save_screenshot(str(path))
    image = Image.open(path).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    background = max(colours)[0]
    assert len(colours) > 50 and background < 0.97 * image.width * image.height, f"{name}: a blank page"
    return path


# --------------------------------------------------------------------------------------------
# in this process: the app's refusals and guards


@pytest.fixture(scope="module")
def client(workdir):
    from starlette.testclient import TestClient

    from groundtune.studio.app import create_app

    with TestClient(create_app(workdir), headers={"x-groundtune-studio": "1"}) as test_client:
        yield test_client


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("method, path, body, said", [
    ("POST", "/api/data/open", {"file": "/etc/passwd"}, "outside the work folder"),
    ("POST", "/api/data/open", {"file": "../../../etc/passwd"}, "outside the work folder"),
    ("POST", "/api/data/open", {"file": "data/link.jsonl"}, "outside the work folder"),  # a link out of it
    ("POST", "/api/data/open", {"file": "data/bad.jsonl"}, "none of its 3 lines is a canonical record"),
    ("POST", "/api/data/open", {"file": "data/none.jsonl"}, "no such file"),
    ("POST", "/api/data/open", {"file": "data"}, "is a folder"),
    ("GET", "/api/runs/metrics?runs=notarun", None, "notarun: not a groundtune run folder"),
    ("POST", "/api/runs/stop", {"run": "notarun"}, "notarun: not a groundtune run folder"),
    ("POST", "/api/runs/resume", {"run": "/tmp"}, "outside the work folder"),
    ("POST", "/api/judge/eval", {"model": "notarun", "data": "data/val.jsonl"}, "not a groundtune run folder"),
    ("POST", "/api/judge/eval", {"model": "tiny", "data": "/etc/hosts"}, "outside the work folder"),
    ("POST", "/api/launch/plan", {"settings": {"out_dir": "../elsewhere"}}, "out_dir=../elsewhere: outside"),
    ("POST", "/api/launch/start", {"settings": {"train_data": "/etc/passwd"}}, "train_data=/etc/passwd: outside"),
    ("POST", "/api/launch/plan", {"settings": {"lr": "fast"}}, "lr"),
    ("GET", "/api/answer.png?file=data/val.jsonl&index=0", None, "not an eval's answers file"),
    ("GET", "/api/data/view?file=data/val.jsonl&line=99", None, "has no record on line '99'"),
    ("POST", "/api/try", {"model": "notarun", "image": "", "phrases": "x"}, "not a groundtune run folder"),
    ("POST", "/api/try", {"model": "tiny", "image": "/etc/passwd", "phrases": "x"}, "the upload:"),
])
def test_a_refusal_is_a_message_and_nothing_is_written(client, workdir, method, path, body, said):
    before = _tree(workdir)
    answer = client.request(method, path, json=body)
    assert answer.status_code == 400 and said in answer.json()["error"], answer.text
    assert _tree(workdir) == before
    assert client.get("/").status_code == 200  # and the studio still answers


def test_a_hub_data_set_is_read_from_its_copy_in_the_cache(client, workdir, monkeypatch):
    from groundtune.data import records
    from groundtune.files import cache_dir

    copy = cache_dir() / "studio-hub-stand-in"
    synth.make_synthetic_set(copy, n=3, seed=4, task="single", split="val", workers=1)
    monkeypatch.setitem(records.REMOTE_DATA, "hf:", lambda spec: copy / "val.jsonl")  # what data/hub.py makes
    opened = client.post("/api/data/open", json={"file": "hf:org/set:val"}).json()
    assert opened["file"] == "hf:org/set:val" and opened["lines"] == 3  # named again by its spec
    page = client.get("/api/data/samples", params={"file": "hf:org/set:val"}).json()
    assert [s["line"] for s in page["samples"]] == [1, 2, 3]
    image = client.get("/api/data/image", params={"file": "hf:org/set:val", "line": 1})
    assert image.status_code == 200 and image.headers["content-type"] == "image/png"  # the cache may be read


def test_paths_are_held_to_the_work_folder(workdir):
    from groundtune.studio.safety import Paths, Refusal

    paths = Paths(workdir)
    assert paths.inside("data/val.jsonl") == workdir.resolve() / "data" / "val.jsonl"
    assert paths.inside(str(workdir / "data")) == workdir.resolve() / "data"
    for outside in ("/etc/passwd", "..", "data/../../x", "~/x", "data/link.jsonl", "a\x00b", ""):
        with pytest.raises(Refusal):
            paths.inside(outside)
    with pytest.raises(Refusal, match="outside the work folder"):
        paths.readable(Path("/etc/hostname"))


def test_a_token_is_needed_off_this_machine_and_a_page_of_elsewhere_is_refused(workdir):
    from starlette.testclient import TestClient

    from groundtune.studio.app import create_app
    from groundtune.studio.safety import COOKIE, loopback, own_hosts

    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and not loopback("0.0.0.0")
    assert own_hosts("0.0.0.0", 80) is None and "127.0.0.1:80" in own_hosts("127.0.0.1", 80)
    with TestClient(create_app(workdir, token="s3cret"), follow_redirects=False) as c:
        assert c.get("/").status_code == 401 and "token" in c.get("/").json()["error"]
        assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        first = c.get("/?token=s3cret")  # the address the studio prints: the token goes to a cookie
        assert first.status_code == 303 and first.headers["location"] == "/"
        assert f"{COOKIE}=s3cret" in first.headers["set-cookie"] and "HttpOnly" in first.headers["set-cookie"]
        c.cookies.set(COOKIE, "s3cret")
        assert c.get("/").status_code == 200
        # a POST without the page's own header: what a form of another site would send
        assert c.post("/api/data/open", json={"file": "data/val.jsonl"}).status_code == 403
    with TestClient(create_app(workdir, hosts=own_hosts("127.0.0.1", 7860)), base_url="http://127.0.0.1:7860") as c:
        assert c.get("/").status_code == 200
        assert c.get("/", headers={"Host": "attacker.example:7860"}).status_code == 403  # DNS rebinding


def test_help_imports_neither_the_web_stack_nor_torch():
    code = ("import sys; from groundtune.cli import build_parser; build_parser().format_help(); "
            "print([m for m in ('fastapi', 'uvicorn', 'starlette', 'torch', 'gradio') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def _answers(folder: Path, name: str, hits: list[bool], phrases: list[str]) -> None:
    """An eval's files as `groundtune eval --out --samples` writes them (evaluate.write_rows's lines)."""
    folder = folder / "studio" / "evals" / name
    folder.mkdir(parents=True)
    rows = [{"id": f"s{i}", "phrase": phrase, "image": "x.png", "width": 10, "height": 10, "split": "val",
             "true_boxes": [[0, 0, 5, 5]] * (1 + i % 2), "pred_boxes": [[0, 0, 5, 5]] if hit else [],
             "iou": 0.9 - 0.1 * i if hit else 0.0, "set_hit": hit, "read": True, "no_target": False,
             "matched": [[0, 0, 1.0]] if hit else [], "extra": [], "missed": []}
            for i, (hit, phrase) in enumerate(zip(hits, phrases))]
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "report.json").write_text(json.dumps({"model": name, "data": "val.jsonl", "n": len(rows),
                                                    "acc@0.5": sum(hits) / len(hits)}))


def test_two_evals_side_by_side_and_the_sorts(client, workdir):
    phrases = ["a b c", "a", "a b c d e", "a b"]
    _answers(workdir, "left", [True, False, True, False], phrases)
    _answers(workdir, "beside", [False, False, True, True], phrases)
    try:
        pairs = client.get("/api/judge/compare?a=left&b=beside&filter=a_right_b_wrong").json()["pairs"]
        assert [(p["a"]["id"], p["a"]["right"], p["b"]["right"]) for p in pairs] == [("s0", True, False)]
        pairs = client.get("/api/judge/compare?a=left&b=beside&filter=b_right_a_wrong").json()["pairs"]
        assert [p["b"]["id"] for p in pairs] == ["s3"]
        assert client.get("/api/judge/compare?a=left&b=beside").json()["shared"] == 4
        ids = lambda sort, order="asc": [a["id"] for a in client.get(
            f"/api/judge/answers?eval=left&sort={sort}&order={order}").json()["answers"]]
        assert ids("iou") == ["s1", "s3", "s2", "s0"]  # worst first: IoU 0, 0, then 0.7, 0.9
        assert ids("phrase_length") == ["s1", "s3", "s0", "s2"]
        assert ids("targets", "desc")[:2] == ["s3", "s1"]  # two true boxes each (the wrong first)
        assert {e["eval"] for e in client.get("/api/judge/evals").json()["evals"]} >= {"left", "beside"}
    finally:
        shutil.rmtree(workdir / "studio" / "evals" / "left")
        shutil.rmtree(workdir / "studio" / "evals" / "beside")


def test_a_job_is_cancelled_with_its_process_group(workdir):
    from groundtune.studio.jobs import Job, Jobs

    jobs = Jobs(workdir)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    jobs.jobs["1"] = Job("1", "eval", ["eval"], workdir / "none.log", sleeper)
    jobs.cancel("1")
    assert sleeper.wait(timeout=10) == -15  # SIGTERM
    assert jobs.get("1").to_json()["state"] == "cancelled"


def test_a_resumed_run_drops_the_answers_of_evals_past_its_checkpoint(tmp_path):
    from groundtune.runs import RunFolder
    from groundtune.train.monitor import MetricsLog

    run = RunFolder(tmp_path)
    run.metrics.write_text('{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n')
    for step in (2, 4):
        run.eval_reports.mkdir(exist_ok=True)
        run.eval_report(step).write_text("{}")
        run.eval_samples(step).write_text("{}\n")
    MetricsLog(tmp_path, resume_step=2, report_to=()).close()
    assert sorted(p.name for p in run.eval_reports.iterdir()) == ["step-000002.json", "step-000002.samples.jsonl"]


# --------------------------------------------------------------------------------------------
# in a browser


def test_the_studio_starts_within_5_s(studio):
    assert studio[1] < 5.0, f"{studio[1]:.1f} s from start to first page"


def _samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@needs_chromium
def test_the_data_tab_draws_every_box(page, workdir, tmp_path):
    records = _samples(workdir / "data" / "train.jsonl")
    _tab(page, "data")
    page.find_element("id", "data-file").send_keys("data/train.jsonl")
    page.find_element("id", "data-open").click()
    _wait(page, lambda d: len(d.find_elements("css selector", "#data-grid .card")) == len(records), "the grid")
    boxes = page.find_elements("css selector", "#data-grid .box")
    assert len(boxes) == sum(len(r["bboxes"]) for r in records) > 0
    assert all(b.size["width"] > 2 and b.size["height"] > 2 for b in boxes)  # drawn, not just there
    _wait(page, lambda d: _js(d, "return [...document.querySelectorAll('#data-grid img')].every("
                                 "i => i.complete && i.naturalWidth > 0)"), "the pictures")
    # a filter: the samples of two targets or more
    _js(page, "const s = document.getElementById('f-targets'); s.value = '2+'; s.dispatchEvent(new Event('change'))")
    several = [r for r in records if len(r["bboxes"]) >= 2]
    _wait(page, lambda d: len(d.find_elements("css selector", "#data-grid .card")) == len(several), "the filter")
    assert len(page.find_elements("css selector", "#data-grid .box")) == sum(len(r["bboxes"]) for r in several)
    # data check's problems as a filter: none in this file
    page.find_element("id", "data-check").click()
    _wait(page, lambda d: "checked" in d.find_element("id", "data-check-state").text, "the data check")
    _js(page, "document.getElementById('f-targets').value = ''; const s = document.getElementById('f-problem'); "
              "s.value = 'none'; s.dispatchEvent(new Event('change'))")
    _wait(page, lambda d: d.find_element("id", "data-count").text == f"{len(records)} samples", "the problem filter")
    # one sample beside what the model sees (data show's cell)
    page.find_element("css selector", "#data-grid .card").click()
    _wait(page, lambda d: _js(d, "const i = document.getElementById('data-view'); return i.complete && i.naturalWidth"),
          "the sample's picture")
    _screenshot(page, tmp_path, "data")


@needs_chromium
def test_a_bad_path_or_file_is_said_in_the_page(page):
    _tab(page, "data")
    for given, said in (("/etc/passwd", "outside the work folder"), ("data/bad.jsonl", "none of its 3 lines")):
        field = page.find_element("id", "data-file")
        field.clear()
        field.send_keys(given)
        page.find_element("id", "data-open").click()
        _wait(page, lambda d, said=said: said in _message(d), f"the refusal of {given}")
        assert "error" in page.find_element("id", "message").get_attribute("class")


def _set_settings(driver, values: dict) -> None:
    _js(driver, "for (const [k, v] of Object.entries(arguments[0])) {"
                "  document.querySelector(`#launch-form input[data-name='${k}']`).value = v; }"
                "document.getElementById('launch-form').dispatchEvent(new Event('input'))", values)


@pytest.fixture(scope="module")
def stopped_run(page, workdir, tmp_path_factory):
    """A quickstart-sized run launched from the page, watched until its loss and an eval's answers
    show, and stopped with the page's button: (its folder, the screenshot of Watch)."""
    _tab(page, "launch")
    _wait(page, lambda d: d.find_elements("css selector", "#launch-form input[data-name='max_steps']"), "the form")
    _js(page, "document.getElementById('launch-card').value = 'cpu'")
    # random weights write junk up to eval_max_new_tokens: a few are enough for the answers to show
    _set_settings(page, {"model": "small_model", "train_data": "data/train.jsonl", "eval_data": "data/val.jsonl",
                         "out_dir": "runs/browser", "max_steps": "2000", "batch_size": "2", "log_every": "1",
                         "eval_every": "4", "eval_samples": "4", "eval_max_new_tokens": "8", "save_every": "0",
                         "num_workers": "0", "warmup_steps": "2"})
    assert not page.find_element("id", "launch-start").is_enabled()  # plan first
    page.find_element("id", "launch-plan").click()
    _wait(page, lambda d: "FITS" in d.find_element("id", "plan-verdict").text, "the plan's verdict")
    page.find_element("id", "launch-start").click()
    _wait(page, lambda d: "started" in _message(d), "the start")
    _tab(page, "watch")
    loss = "#watch-latest tr[data-run='runs/browser'] .loss"
    _wait(page, lambda d: d.find_elements("css selector", loss) and d.find_element("css selector", loss).text != "-",
          "the run's loss on the page")
    _wait(page, lambda d: len(d.find_elements("css selector", "#watch-eval .card")) >= 2, "an eval's answers")
    shot = _screenshot(page, tmp_path_factory.mktemp("watch"), "watch")
    _js(page, "document.querySelector(\"input[data-run='runs/browser']\").closest('.row')"
              ".querySelector('.run-stop').click()")
    _wait(page, lambda d: "STOP" in _message(d), "the stop")
    run = workdir / "runs" / "browser"
    _wait(page, lambda d: (run / "model" / "groundtune.json").exists() and not (run / ".lock").exists(),
          "the run to save and stop")
    return run, shot


@needs_chromium
def test_a_launched_run_streams_its_loss_and_stops_from_the_button(stopped_run):
    run, _ = stopped_run
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "loss" in line]
    assert steps and steps[-1] < 2000  # stopped long before max_steps
    log = next((run.parent.parent / "studio" / "jobs").glob("*-train-*.log")).read_text()
    assert "STOP exists" in log, log[-2000:]
    assert list((run / "eval").glob("step-*.samples.jsonl"))  # the answers the page showed


@needs_chromium
def test_the_judge_tab_lists_the_worst_answer_first(page, stopped_run, tmp_path):
    _tab(page, "judge")
    _wait(page, lambda d: _js(d, "return [...document.getElementById('judge-model').options].some("
                                 "o => o.value === 'runs/browser')"), "the run among the models")
    # trained weights: answers right and wrong to sort (the run's random model gets none right)
    _js(page, "document.getElementById('judge-model').value = 'tiny'")
    page.find_element("id", "judge-data").send_keys("data/val.jsonl")
    page.find_element("id", "judge-run").click()
    # read the list in one script: the page may redraw it between finding a card and reading it
    read_ious = ("return [...document.querySelectorAll('#judge-list .card')]"
                 ".map(c => parseFloat(c.dataset.iou || '1'))")
    _wait(page, lambda d: len(_js(d, read_ious)) == 6, "the eval's answers")
    ious = _js(page, read_ious)
    assert ious[0] == min(ious) and ious == sorted(ious)
    _wait(page, lambda d: _js(d, "return [...document.querySelectorAll('#judge-list img')].every("
                                 "i => i.complete && i.naturalWidth > 0)"), "the answers' pictures")
    _screenshot(page, tmp_path, "judge")


@needs_chromium
def test_the_try_tab_returns_boxes(page, workdir, tmp_path):
    _tab(page, "try")  # the tiny model: trained weights answer with a box
    _wait(page, lambda d: d.find_element("id", "try-model").get_attribute("value") == "tiny", "the models")
    page.find_element("id", "try-image").send_keys(str(workdir / "shape.png"))
    phrase = synth.make_sample(seed=3, index=0, task="single")[1]["phrase"]
    page.find_element("id", "try-phrases").send_keys(phrase)
    _wait(page, lambda d: _js(d, "return document.getElementById('try-canvas').width > 0"), "the image drawn")
    page.find_element("id", "try-go").click()
    _wait(page, lambda d: d.find_element("id", "try-result").get_attribute("data-boxes") is not None, "the answer")
    assert int(page.find_element("id", "try-result").get_attribute("data-boxes")) >= 1
    assert phrase in page.find_element("id", "try-result").text
    _screenshot(page, tmp_path, "try")
