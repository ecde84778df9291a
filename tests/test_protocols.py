"""Evaluation protocols (protocols.py): the harnesses' readings against their own code where it
installs, the mis-reading they suffer on Qwen2.5-VL's absolute pixels, the published table, and
`groundtune eval --protocol` end to end on a small random model (the CLI's `main()` in this
process), and bench/reproduce_refcoco.sh as a user runs it (a real bash and Python process: the
script is what is tested)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from cli_in_process import groundtune

from groundtune import boxes, protocols
from groundtune.evaluate import score

# (raw answer, image width, height, true box xyxy in pixels): answers as models write them
W, H = 640, 480
TRUE = [128.0, 96.0, 320.0, 288.0]
ANSWERS = [
    "[0.2, 0.2, 0.5, 0.6]",  # fractions, on target
    "The box is [0.21, 0.19, 0.52, 0.61].",  # chatter around it
    "[0.6, 0.6, 0.9, 0.9]",  # fractions, elsewhere
    '```json\n[{"bbox_2d": [128, 96, 320, 288], "label": "dog"}]\n```',  # Qwen2.5-VL: absolute pixels, on target
    "[128, 96, 320, 288]",  # bare absolute pixels
    "[200, 200, 500, 600]",  # per mille, as Qwen2-VL and Qwen3-VL write
    "no box here",
    "[0.2,0.2,0.5,0.6] and [0.6,0.6,0.9,0.9]",  # two boxes: the first counts
    "[1e-1, 0.2, 0.5, 0.6]",  # exponent notation
]


def hit(pred_box: list[float] | None) -> bool:
    """eval's own Acc@0.5 rule (evaluate.score), the same in every protocol, against TRUE."""
    return score(pred_box, [TRUE])["hit@0.5"]


def _lmms_eval_module():
    """lmms-eval's own refcoco utils, loaded from its installed file (its package __init__ pulls in
    its whole runtime); None where lmms-eval is not installed (`pip install lmms-eval`, with
    `--no-deps` where its CUDA requirements cannot install)."""
    spec = importlib.util.find_spec("lmms_eval")
    if spec is None or importlib.util.find_spec("datasets") is None:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "tasks" / "refcoco" / "utils_rec.py"
    module_spec = importlib.util.spec_from_file_location("lmms_eval_refcoco_utils_rec", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_lmms_eval_acc_equals_its_own_code():
    """The same raw answers scored by lmms-eval's functions (its preprocessing of the true box, its
    parser, its Acc@0.5 aggregation) and by groundtune's lmms-eval protocol give the same Acc@0.5,
    answer by answer."""
    lmms = _lmms_eval_module()
    if lmms is None:
        pytest.skip("lmms-eval is not installed (an optional test extra: pip install lmms-eval)")
    from datasets import Dataset
    from PIL import Image

    x1, y1, x2, y2 = TRUE
    doc = {"image": Image.new("RGB", (W, H)), "bbox": [x1, y1, x2 - x1, y2 - y1], "question_id": "q",
           "answer": ["the dog"]}
    (prepared,) = list(lmms.refcoco_bbox_rec_preprocess_dataset(Dataset.from_list([doc])))
    for raw in ANSWERS:
        theirs = lmms.refcoco_bbox_rec_acc05([lmms.refcoco_bbox_rec_process_result(prepared, [raw])["refcoco_ACC@0.5"]])
        ours = hit(protocols.read_answer("lmms-eval", raw, W, H)[0])
        assert bool(theirs) == ours, raw


def test_the_harnesses_misread_qwen25_absolute_pixels():
    """A Qwen2.5-VL answer exactly on the true box, in the absolute pixels that model writes: our
    reading (and Qwen's) hits it; lmms-eval reads the numbers as fractions of the image, VLMEvalKit
    as per mille (no number above 1000): both miss. Why numbers differ between harnesses."""
    raw = '[{"bbox_2d": [128, 96, 320, 288], "label": "dog"}]'
    native = boxes.parse_answer(raw, "qwen2.5-vl", (W, H), (W, H))
    assert hit(native.box)
    assert not hit(protocols.read_answer("lmms-eval", raw, W, H)[0])
    misread = protocols.read_answer("vlmevalkit", raw, W, H)[0]
    assert misread == pytest.approx([128 * W / 1000, 96 * H / 1000, 320 * W / 1000, 288 * H / 1000])
    assert not hit(misread)
    # the same box in fractions, as lmms-eval asks, is read right by both harnesses
    fractions = f"[{128 / W}, {96 / H}, {320 / W}, {288 / H}]"
    assert hit(protocols.read_answer("lmms-eval", fractions, W, H)[0])
    assert hit(protocols.read_answer("vlmevalkit", fractions, W, H)[0])


@pytest.mark.parametrize("raw, expected", [
    ("[0.25, 0.5, 0.75, 1.0]", [160.0, 240.0, 480.0, 480.0]),  # fractions
    ("[250, 500, 750, 1000]", [160.0, 240.0, 480.0, 480.0]),  # per mille
    ("[1200, 100, 100, 50]", [100.0, 50.0, 640.0, 100.0]),  # pixels: clipped, corners ordered
    ("x 0.1 y 0.2 to 0.3 0.4", [64.0, 96.0, 192.0, 192.0]),  # no brackets: the first four numbers
    ("[1, 2]", None),
])
def test_vlmevalkit_reading_follows_its_rules(raw, expected):
    found = protocols.read_answer("vlmevalkit", raw, W, H)
    assert (found[0] if found else None) == (pytest.approx(expected) if expected else None)


def test_lmms_eval_reading_falls_back_to_a_zero_box():
    assert protocols.read_answer("lmms-eval", "no box here", W, H) == [[0.0, 0.0, 0.0, 0.0]]
    assert protocols.read_answer("lmms-eval", "[1e-1, 0.2, 0.5, 0.6]", W, H) == [[0.0, 0.0, 0.0, 0.0]]


def test_every_published_figure_has_a_source_and_all_eight_splits():
    rows = protocols.published()
    assert rows and all(r["source"] and 0 < r["acc@0.5"] <= 100 and r["protocol"] in protocols.PROTOCOLS
                        for r in rows)
    for model in {r["model"] for r in rows}:
        splits = {(r["benchmark"], r["split"]) for r in rows if r["model"] == model}
        assert len(splits) == 8, model
    row = protocols.published_figure("Qwen/Qwen2.5-VL-3B-Instruct", "refcoco", "val", "qwen")
    assert row["acc@0.5"] == 89.1
    assert protocols.published_figure("Qwen/Qwen2.5-VL-3B-Instruct", "refcoco", "val", "lmms-eval") is None
    assert protocols.benchmark_of("hf:lmms-lab/RefCOCOplus:testA", []) == "refcoco+"
    assert protocols.benchmark_of("val.jsonl", [{"source": "refcocog"}]) == "refcocog"


@pytest.mark.slow
def test_eval_protocol_end_to_end(synth_single, tmp_path, small_model):
    """`groundtune eval --protocol lmms-eval` on the small model: the harness's prompt is asked, its
    reading applied (every answer read to one box, [0,0,0,0] where none is found), and both are
    recorded in the report; an unknown protocol exits 2 before a model loads."""
    data = synth_single / "val.jsonl"
    out = tmp_path / "report.json"
    done = groundtune("eval", "--model", small_model, "--data", data, "--protocol", "lmms-eval", "--limit", "4",
                      "--max-new-tokens", "8", "--out", out)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["protocol"]["name"] == "lmms-eval"
    assert report["prompt"] == protocols.PROTOCOLS["lmms-eval"].prompt
    assert report["n"] == 4 and report["parse_fail_rate"] == 0  # the harness reads every answer to a box
    bad = groundtune("eval", "--model", small_model, "--data", data, "--protocol", "nope")
    assert bad.returncode == 2 and "--protocol" in bad.stderr


@pytest.mark.slow
def test_reproduce_refcoco_writes_the_side_by_side_table(synth_single, tmp_path, small_model):
    """bench/reproduce_refcoco.sh on a small random model and local files standing in for the eight
    splits: one eval report per split and the table (measured beside published, '-' where no
    figure is published for the model)."""
    records = [json.loads(line) for line in (synth_single / "val.jsonl").read_text().splitlines()][:2]
    folder = tmp_path / "refcoco"
    folder.mkdir()
    splits = [("refcoco", "val"), ("refcoco", "testA"), ("refcoco", "testB"), ("refcoco+", "val"),
              ("refcoco+", "testA"), ("refcoco+", "testB"), ("refcocog", "val"), ("refcocog", "test")]
    for benchmark, split in splits:
        rows = [dict(r, image=str(synth_single / r["image"]), source=benchmark, split=split) for r in records]
        (folder / f"{benchmark}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(["bash", str(root / "bench" / "reproduce_refcoco.sh"), small_model, "qwen", str(out)],
                          check=False, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "REFCOCO_DIR": str(folder),
                               "EVAL_ARGS": "--max-new-tokens 8 --batch-size 2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = json.loads((out / "table.json").read_text())
    assert {(r["benchmark"], r["split"]) for r in table["rows"]} == set(splits)
    assert all(r["n"] == 2 and r["published_acc@0.5"] is None for r in table["rows"])
    assert "| RefCOCO+ | testA | 2 |" in (out / "table.md").read_text()
