"""Grounding evaluation: a phrase names a SET of boxes (one, several or none), and eval scores both
the single-box answer RefCOCO's papers quote and the set, overall and per split and source, plus an
HTML gallery of the worst and a sample of the best answers.

    groundtune eval --model runs/sft --data data/synth/val.jsonl --out report.json --gallery gallery/
    groundtune eval --model runs/rl --compare runs/sft --data val.jsonl

Single-target metrics (Acc@0.5, Acc@0.75, Acc@0.5:0.95, mIoU), RefCOCO's meaning: the IoU of the
model's FIRST box with the best-matching true box, over the samples that HAVE a target (a no-target
sample has no box to hit; it is scored by the set metrics below). An answer without a usable box
scores IoU 0 there: it is never replaced by a guessed box.

Set metrics: predicted and true boxes are matched one to one at IoU >= 0.5 (``boxes.match_boxes``,
optimal, the same function RL's reward uses). Micro over boxes: precision = matched / predicted,
recall = matched / true, F1 = 2 matched / (predicted + true). ``set_acc@0.5`` (gRefCOCO's
Pr@(F1=1, IoU>=0.5)): the share of samples answered exactly, every true box matched and no box
extra; a no-target sample is right when answered with no box (``[]``). ``n_acc``: no-target samples
answered with no box; ``t_acc``: target samples answered with at least one box. AP (COCO's, by
pycocotools) when the model scores its boxes (a box head's objectness).

A no-target answer (``[]``) was read: it is never a parse failure. ``parse_fail_rate`` counts the
answers that could not be read at all, over every sample; such an answer is wrong on every metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import io
import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from groundtune import boxes, infer, protocols
from groundtune.config import InferSettings
from groundtune.errors import UsageError
from groundtune.data.images import drawn_by, load_image, png_info
from groundtune.data.records import atomic_write, image_path, read_samples, sample_boxes
from groundtune.data.refgen import MODEL_FILTER_IOU

THRESHOLDS = [round(0.5 + 0.05 * i, 2) for i in range(10)]  # 0.5, 0.55, ..., 0.95 (COCO's)
THRESHOLD_CHOICES = [round(0.05 * i, 2) for i in range(1, 20)]  # a box head's objectness threshold: 0.05 ... 0.95
METRICS = ["acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou", "parse_fail_rate"]
SET_METRICS = ["precision@0.5", "recall@0.5", "f1@0.5", "set_acc@0.5", "n_acc", "t_acc"]
AP_METRICS = ["ap@0.5:0.95", "ap@0.5"]
HEADERS = {"acc@0.5": "Acc@.5", "acc@0.75": "Acc@.75", "acc@0.5:0.95": "Acc@.5:.95", "miou": "mIoU",
           "parse_fail_rate": "parse fail", "precision@0.5": "P@.5", "recall@0.5": "R@.5", "f1@0.5": "F1@.5",
           "set_acc@0.5": "set acc", "n_acc": "N-acc", "t_acc": "T-acc", "ap@0.5:0.95": "AP", "ap@0.5": "AP@.5"}
DEFINITIONS = {
    "acc@0.5": "single-target: share of samples with a target whose FIRST predicted box has IoU >= 0.5 with "
               "the best-matching true box (no-target samples are left out; see n_acc)",
    "acc@0.75": "as acc@0.5, at IoU >= 0.75",
    "acc@0.5:0.95": "as acc@0.5, averaged over IoU thresholds 0.5, 0.55, ..., 0.95",
    "miou": "single-target: mean IoU of the first predicted box with the best-matching true box, over samples "
            "with a target (0 without a box)",
    "parse_fail_rate": "share of all samples whose answer could not be read (a no-target answer [] was read)",
    "precision@0.5": "matched predicted boxes / predicted boxes, over all samples; boxes matched one to one at "
                     "IoU >= 0.5, optimally (most pairs, then most IoU)",
    "recall@0.5": "matched true boxes / true boxes, over all samples",
    "f1@0.5": "2 matched / (predicted + true boxes)",
    "set_acc@0.5": "share of samples answered exactly: every true box matched, no predicted box extra; a "
                   "no-target sample answered [] counts as right (gRefCOCO's Pr@(F1=1, IoU>=0.5))",
    "n_acc": "share of no-target samples answered [] (null when there are none)",
    "t_acc": "share of samples with a target answered with at least one box",
    "ap@0.5:0.95": "COCO AP averaged over IoU 0.5:0.95 (pycocotools' COCOeval, one category, 100 boxes per "
                   "sample), from the boxes' scores; present only when every answer's boxes are scored",
    "ap@0.5": "COCO AP at IoU 0.5, as ap@0.5:0.95",
}
TRUE_COLOUR = (0, 200, 0)  # a true box, found
PRED_COLOUR = (230, 0, 0)  # a predicted box that matched a true box
MISSED_COLOUR = (0, 110, 255)  # a true box no predicted box matched
EXTRA_COLOUR = (210, 0, 210)  # a predicted box that matched no true box
INVALID_COLOUR = (255, 140, 0)  # a "box" with no area (x2 <= x1 or y2 <= y1): dashed, labelled invalid


# Why a run is judged by a measure other than Acc@0.5 (the training log's line and a model card say it)
HEADLINE_REASONS = {
    "f1@0.5": "the eval set asks for sets (a phrase naming several objects or none), where F1@0.5 counts every "
              "box missed or extra and Acc@0.5, the first box of one-object phrases, cannot",
    "set_acc@0.5": "the eval set's phrases name nothing, so set accuracy@0.5 (the share answered []) is the measure",
}


def headline(report: dict) -> tuple[str, float | None]:
    """(key, value) of the number a report is judged by (a run keeps its best model by it, a model
    card leads with it): ``acc@0.5``, the single-target metric, on an eval set of one-object phrases;
    ``f1@0.5`` on one that asks for sets (a sample with several true boxes, or none) or where
    Acc@0.5 has no sample to count: Acc@0.5 reads the first box of one-target samples only, so a
    run on sets kept by it keeps a model that misses boxes or answers one to a phrase naming
    nothing (RL on synth:every kept its starting model so); on a set of no-target samples only,
    ``set_acc@0.5``, the share answered ``[]`` (F1 there is 0 or undefined whatever the answers).
    Which key applies depends on the eval set alone, never on the answers, so every eval of a run
    is compared on one metric. The value is None only for a report of no samples."""
    asks_for_sets = bool(report.get("several_true_boxes") or report.get("n_no_target"))
    if report.get("recall@0.5") is not None and (asks_for_sets or report.get("acc@0.5") is None):
        return "f1@0.5", report["f1@0.5"]  # some true box: F1 is a number
    if report.get("acc@0.5") is not None:
        return "acc@0.5", report["acc@0.5"]
    return "set_acc@0.5", report.get("set_acc@0.5")


def score(pred_box: list[float] | None, true_boxes: list[list[float]]) -> dict:
    """IoU of the predicted box with the best-matching true box (0 when there is no prediction)."""
    best = boxes.best_iou(pred_box, true_boxes)
    return {"iou": best, "hit@0.5": best >= 0.5, "hit@0.75": best >= 0.75}


def score_answer(pred: infer.Prediction, true_boxes: list[list[float]]) -> dict:
    """Everything eval reads off one answer: the single-target score of its first box (``iou`` None
    on a no-target sample) and its set score: ``matched`` [pred index, true index, IoU] pairs at IoU
    >= 0.5, the ``missed`` true and ``extra`` predicted boxes' indices, and ``set_hit`` (exact)."""
    read = bool(pred.boxes) or pred.no_target
    matched = boxes.match_boxes(pred.boxes, true_boxes, boxes.iou, boxes.MATCH_IOU)
    single = score(pred.bbox, true_boxes) if true_boxes else {"iou": None, "hit@0.5": False, "hit@0.75": False}
    return {
        "pred_bbox": pred.bbox,
        "pred_boxes": pred.boxes,
        "no_target": pred.no_target,
        "scores": pred.scores,
        "read": read,
        **single,
        "matched": [list(m) for m in matched],
        "missed": sorted(set(range(len(true_boxes))) - {j for _, j, _ in matched}),
        "extra": sorted(set(range(len(pred.boxes))) - {i for i, _, _ in matched}),
        # A no-target sample is right only when the answer was read as []: a parse failure has no box
        # either, but it did not say "none".
        "set_hit": read and len(matched) == len(true_boxes) == len(pred.boxes),
    }


def best_threshold(predictions: list[infer.Prediction], samples: list[dict]) -> float:
    """The objectness threshold of a box head's answers (made at the lowest of ``THRESHOLD_CHOICES``)
    with the best F1@0.5 on ``samples``, the highest of equals: what a run's box head keeps on
    its eval set, chosen from it instead of by hand."""
    true = [sample_boxes(sample) for sample in samples]
    best, best_f1 = THRESHOLD_CHOICES[0], -1.0
    for threshold in THRESHOLD_CHOICES:
        matched = predicted = 0
        for pred, boxes_ in zip(predictions, true):
            kept = pred.above(threshold).boxes
            matched += len(boxes.match_boxes(kept, boxes_, boxes.iou, boxes.MATCH_IOU))
            predicted += len(kept)
        f1 = 2 * matched / max(predicted + sum(map(len, true)), 1)
        if f1 >= best_f1:
            best, best_f1 = threshold, f1
    return best


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _metrics(rows: list[dict]) -> dict:
    n = len(rows)
    if n == 0:
        return {"n": 0, "n_target": 0, "n_no_target": 0, "several_true_boxes": 0, **{m: None for m in METRICS + SET_METRICS},
                "matched@0.5": 0, "missed@0.5": 0, "extra@0.5": 0}
    target = [r for r in rows if r["true_boxes"]]
    no_target = [r for r in rows if not r["true_boxes"]]
    ious = [r["iou"] for r in target]
    acc = {t: _ratio(sum(i >= t for i in ious), len(target)) for t in THRESHOLDS}
    matched = sum(len(r["matched"]) for r in rows)
    predicted = sum(len(r["pred_boxes"]) for r in rows)
    true = sum(len(r["true_boxes"]) for r in rows)
    out = {
        "n": n,
        "n_target": len(target),
        "n_no_target": len(no_target),
        "several_true_boxes": sum(len(r["true_boxes"]) > 1 for r in rows),
        "acc@0.5": acc[0.5],
        "acc@0.75": acc[0.75],
        "acc@0.5:0.95": sum(acc.values()) / len(THRESHOLDS) if target else None,
        "miou": _ratio(sum(ious), len(target)),
        "parse_fail_rate": sum(not r["read"] for r in rows) / n,
        "precision@0.5": _ratio(matched, predicted),
        "recall@0.5": _ratio(matched, true),
        "f1@0.5": _ratio(2 * matched, predicted + true),
        "set_acc@0.5": sum(r["set_hit"] for r in rows) / n,
        "n_acc": _ratio(sum(r["no_target"] for r in no_target), len(no_target)),
        "t_acc": _ratio(sum(bool(r["pred_boxes"]) for r in target), len(target)),
        "matched@0.5": matched,
        "missed@0.5": true - matched,
        "extra@0.5": predicted - matched,
    }
    if _scored(rows):
        out.update(average_precision(rows))
    return out


def _scored(rows: list[dict]) -> bool:
    """Whether AP can be computed: every answer that holds boxes scores each of them, and some
    answer carries scores (a text model's never do)."""
    for r in rows:
        if r["pred_boxes"] and (r["scores"] is None or len(r["scores"]) != len(r["pred_boxes"])):
            return False
    return any(r["scores"] is not None for r in rows)


def average_precision(rows: list[dict]) -> dict:
    """COCO's AP@[.5:.95] and AP@0.5 of scored answers, by pycocotools' own COCOeval: every sample
    an image of one category, its true boxes the ground truth (a no-target sample has none, so any
    box there is a false positive), its predicted boxes the detections with their scores. None when
    there is no true box at all (AP has no recall to average over)."""
    from pycocotools.coco import COCO  # imported here: only scored answers need it
    from pycocotools.cocoeval import COCOeval

    images, truths, detections = [], [], []
    for k, r in enumerate(rows, start=1):  # COCO ids start at 1: COCOeval reads id 0 as "unmatched"
        images.append({"id": k, "width": r["width"], "height": r["height"]})
        for box in r["true_boxes"]:
            x, y, w, h = boxes.xyxy_to_xywh(box)
            truths.append({"id": len(truths) + 1, "image_id": k, "category_id": 1, "bbox": [x, y, w, h],
                           "area": w * h, "iscrowd": 0})
        for box, s in zip(r["pred_boxes"], r["scores"] or []):
            detections.append({"image_id": k, "category_id": 1, "bbox": boxes.xyxy_to_xywh(box), "score": float(s)})
    if not truths:
        return {"ap@0.5:0.95": None, "ap@0.5": None}
    if not detections:  # loadRes cannot take an empty list; nothing found is AP 0
        return {"ap@0.5:0.95": 0.0, "ap@0.5": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and summary
        truth = COCO()
        # "info" as the COCO format has it: pycocotools 2.0.10's loadRes copies it (KeyError without)
        truth.dataset = {"info": {}, "images": images, "annotations": truths,
                         "categories": [{"id": 1, "name": "target"}]}
        truth.createIndex()
        run = COCOeval(truth, truth.loadRes(detections), "bbox")
        run.evaluate()
        run.accumulate()
        run.summarize()
    return {"ap@0.5:0.95": float(run.stats[0]), "ap@0.5": float(run.stats[1])}


def _group(rows: list[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r.get(key) if r.get(key) is not None else "-"), []).append(r)
    return dict(sorted(groups.items()))


def summarise(rows: list[dict]) -> dict:
    """Metrics over scored rows (each holds ``true_boxes``, ``width``, ``height`` and
    ``score_answer``'s fields), overall and per split/source."""
    return {
        **_metrics(rows),
        "by_split": {k: _metrics(g) for k, g in _group(rows, "split").items()},
        "by_source": {k: _metrics(g) for k, g in _group(rows, "source").items()},
    }


def evaluate(gm, samples: list[dict], data_path, batch_size: int = InferSettings.batch_size,
             limit: int | None = None, progress: bool = True, max_new_tokens: int = InferSettings.max_new_tokens,
             predictions: list | None = None, protocol: str = protocols.DEFAULT_PROTOCOL) -> tuple[dict, list[dict]]:
    """Predict (greedy) and score every sample; returns (report, one row per sample). The report
    records what was measured and how: model, data, family, pixel budget, prompt, decoding.

    Images are read in worker processes one batch at a time (``infer.predict_records``), so a large
    eval set never sits in memory at once. ``predictions``: the samples' predictions made already
    (by several training ranks, each its share, with these settings), scored instead. ``protocol``:
    whose prompt is asked and whose rules read the answers (protocols.py), recorded in the report.
    """
    samples = samples[:limit] if limit is not None else samples
    if not samples:
        raise ValueError(f"{data_path}: no samples to evaluate")
    rules = protocols.protocol(protocol)
    box_head = gm.metadata()["head"] == "box"
    if box_head and protocol != "groundtune":
        raise UsageError(f"--protocol {protocol} asks for a text answer; a box-head model answers boxes "
                         "(use --protocol groundtune)")
    gm = dataclasses.replace(gm, prompt=rules.prompt_for(gm.prompt))
    preds = predictions if predictions is not None else infer.predict_records(
        gm, samples, data_path, batch_size, max_new_tokens, progress="eval" if progress else None)
    if not rules.native:  # the harness's own reading of the same answers
        preds = [_read_as(protocol, pred, sample) for pred, sample in zip(preds, samples)]
    rows = []
    for sample, pred in zip(samples, preds):
        true = sample_boxes(sample)
        rows.append({
            "id": sample["id"],
            "phrase": sample["phrase"],
            "image": sample["image"],
            "width": int(sample["width"]),
            "height": int(sample["height"]),
            "true_boxes": true,
            **score_answer(pred, true),
            "raw": pred.raw,
            "error": pred.error,
            "split": sample.get("split"),
            "source": sample.get("source"),
        })
    summary = summarise(rows)
    report = {
        "model": gm.source,
        "data": str(data_path),
        "family": gm.family,
        "resize": gm.resize.to_dict(),
        "prompt": gm.prompt,
        "protocol": {"name": rules.name, "source": rules.source},
        "head": "box" if box_head else "text",
        "decoding": ({"box_head": "one forward pass, no token decoding"} if box_head
                     else infer.Decoding.greedy(max_new_tokens).to_dict()),
        **summary,
        "definitions": {k: v for k, v in DEFINITIONS.items() if k in summary},  # the report says what it measured
    }
    return report, rows


def _read_as(protocol: str, pred: infer.Prediction, sample: dict) -> infer.Prediction:
    """``pred``'s raw answer read by a harness protocol's rules (protocols.py) instead of ours."""
    found = protocols.read_answer(protocol, pred.raw, float(sample["width"]), float(sample["height"]))
    return infer.Prediction(bbox=found[0] if found else None, boxes=found, label=None, raw=pred.raw,
                            error=None if found else f"no box found by {protocol}'s reading")


def published_beside(report: dict, samples: list[dict], data) -> dict | None:
    """The published figure for this model, benchmark, split and protocol (protocols.published),
    with the measured one, when there is one."""
    splits = {s.get("split") for s in samples}
    split = splits.pop() if len(splits) == 1 else None
    row = protocols.published_figure(report["model"], protocols.benchmark_of(str(data), samples), split,
                                     report["protocol"]["name"])
    if row is None or report.get("acc@0.5") is None:
        return None
    return {**row, "measured_acc@0.5": round(100 * report["acc@0.5"], 1)}


def filter_by_model(gm, records: list[dict], data_path, min_iou: float = MODEL_FILTER_IOU, flag_only: bool = False,
                    batch_size: int = InferSettings.batch_size, progress: bool = True) -> tuple[list[dict], int]:
    """Self-consistency for generated phrases (``data refgen --filter-model``): ground each phrase
    with ``gm`` (greedy, as eval) and keep those whose box comes back at IoU >= ``min_iou``; with
    ``flag_only`` keep every record, each with ``model_iou`` and ``model_agrees`` added. Returns
    (records, how many came back). It lives here, not in data/, because data/ knows no model.

    What it catches is what the model cannot read, not what is false: the phrases themselves are
    verified from the boxes (data/refcheck.py). A weak model drops hard but true phrases."""
    if not records:
        return [], 0
    preds = infer.predict_records(gm, records, data_path, batch_size, progress="filter" if progress else None)
    out, agreed = [], 0
    for record, pred in zip(records, preds):
        iou = boxes.best_iou(pred.bbox, sample_boxes(record))
        agreed += iou >= min_iou
        if flag_only:
            out.append({**record, "model_iou": round(iou, 4), "model_agrees": iou >= min_iou})
        elif iou >= min_iou:
            out.append(record)
    return out, agreed


# --------------------------------------------------------------------------------------------
# Gallery


def draw_boxes(image: Image.Image, true_boxes: list[list[float]], pred_box: list[float] | None) -> Image.Image:
    """A copy of the original image with the true boxes in green and the predicted box in red."""
    return _draw(image, [(b, TRUE_COLOUR) for b in true_boxes] + ([(pred_box, PRED_COLOUR)] if pred_box else []))


def draw_answer(image: Image.Image, true_boxes: list[list[float]], pred_boxes: list[list[float]],
                matched: list) -> Image.Image:
    """A copy of the original image with a set answer drawn against the truth: true boxes found in
    green, missed in blue; predicted boxes that matched in red, extra ones in magenta (``matched``:
    ``score_answer``'s pairs)."""
    found_true, found_pred = {j for _, j, _ in matched}, {i for i, _, _ in matched}
    return _draw(image, [(b, TRUE_COLOUR if j in found_true else MISSED_COLOUR) for j, b in enumerate(true_boxes)]
                 + [(b, PRED_COLOUR if i in found_pred else EXTRA_COLOUR) for i, b in enumerate(pred_boxes)])


def _draw(image: Image.Image, outlined: list[tuple[list[float], tuple]]) -> Image.Image:
    """Small images are enlarged (nearest neighbour) so a 2 px outline does not hide the object.
    A box without area (``boxes.has_area``: x1 > x2, say, from a harness's reading) is not drawn as
    the box its sorted corners would make: it is dashed, in INVALID_COLOUR, and labelled."""
    scale = max(1, 320 // max(image.size))
    out = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(out)
    width = max(2, max(out.size) // 200)
    for box, colour in outlined:
        if boxes.has_area(box):
            draw.rectangle([v * scale for v in box], outline=colour, width=width)
        else:
            _draw_invalid(draw, [v * scale for v in box], width)
    return out


def _draw_invalid(draw: ImageDraw.ImageDraw, box: list[float], width: int) -> None:
    """Dashes along the rectangle the corners span (a cross where they meet in one point), and the
    word "invalid" beside it."""
    x1, x2 = sorted((box[0], box[2]))
    y1, y2 = sorted((box[1], box[3]))
    if x2 - x1 < 2 * width and y2 - y1 < 2 * width:  # a point: nothing to dash
        r = 3 * width
        draw.line([x1 - r, y1 - r, x1 + r, y1 + r], fill=INVALID_COLOUR, width=width)
        draw.line([x1 - r, y1 + r, x1 + r, y1 - r], fill=INVALID_COLOUR, width=width)
    dash = 3 * width
    for ax, ay, bx, by in ((x1, y1, x2, y1), (x2, y1, x2, y2), (x2, y2, x1, y2), (x1, y2, x1, y1)):
        pieces = max(1, round(max(abs(bx - ax), abs(by - ay)) / dash))
        for k in range(0, pieces, 2):  # every other piece: a dash, then a gap
            a, b = k / pieces, min(1.0, (k + 1) / pieces)
            draw.line([ax + (bx - ax) * a, ay + (by - ay) * a, ax + (bx - ax) * b, ay + (by - ay) * b],
                      fill=INVALID_COLOUR, width=width)
    draw.text((x1 + width, y1 + width), "invalid", fill=INVALID_COLOUR)


def badness(row: dict) -> tuple:
    """Sort key, worst first: unread answers, then wrong sets (fewest boxes right), then low IoU."""
    right = 2 * len(row["matched"])
    total = len(row["pred_boxes"]) + len(row["true_boxes"])
    return (row["read"], row["set_hit"], right / total if total else 1.0, row["iou"] if row["iou"] is not None else 1.0)


GALLERY_WORST, GALLERY_BEST = 24, 12  # answers drawn: the worst, and a sample of the exact ones
GALLERY_TITLE = "groundtune eval gallery"  # in its index.html: a later gallery may replace it
GALLERY_DRAWN_BY = "groundtune eval --gallery"  # in each PNG it draws: likewise


def gallery_files(folder, n_worst: int = GALLERY_WORST, n_best: int = GALLERY_BEST) -> list[Path]:
    """Every file ``write_gallery`` may write in ``folder``: what eval checks it may write before
    the model loads."""
    folder = Path(folder)
    return ([folder / "index.html"] + [folder / _card_name("worst", k) for k in range(n_worst)]
            + [folder / _card_name("best", k) for k in range(n_best)])


def _card_name(section: str, k: int) -> str:
    return f"{section}_{k:03d}.png"


def written_by_gallery(path: Path) -> bool:
    """Whether ``path`` is a file an eval gallery wrote (its PNG text, its index's title): the next
    gallery may replace it without --overwrite."""
    if path.suffix == ".png":
        return drawn_by(path, GALLERY_DRAWN_BY)
    try:
        with open(path, encoding="utf-8") as f:
            return f"<title>{GALLERY_TITLE}</title>" in f.read(4096)
    except (OSError, ValueError):  # ValueError: not UTF-8
        return False


def write_gallery(rows: list[dict], data_path, out_dir, n_worst: int = GALLERY_WORST, n_best: int = GALLERY_BEST,
                  seed: int = 0) -> Path:
    """Draw the worst answers (parse failures first, then wrong sets, then lowest IoU) and a random
    sample of the exact ones (``set_hit``), and write ``index.html`` listing them (``gallery_files``
    names them); returns its path."""
    out_dir = Path(out_dir)
    ranked = sorted(range(len(rows)), key=lambda i: badness(rows[i]))
    worst = ranked[:n_worst]
    hits = [i for i in ranked[n_worst:] if rows[i]["set_hit"]]
    best = random.Random(seed).sample(hits, min(n_best, len(hits)))
    sections = []
    for title, name, chosen in [("Worst", "worst", worst), ("Best (random sample of exact answers)", "best", best)]:
        cards = [_card(rows[i], data_path, out_dir, _card_name(name, k)) for k, i in enumerate(chosen)]
        sections.append(f"<h2>{title}: {len(chosen)}</h2>\n<div class=grid>\n" + "\n".join(cards) + "\n</div>")
    index = out_dir / "index.html"
    with atomic_write(index) as f:
        f.write(_PAGE.format(title=GALLERY_TITLE, n=len(rows), body="\n".join(sections)))
    return index


def write_rows(rows: list[dict], data_path, path, model: str | None = None) -> Path:
    """The answers of an eval, one JSON line a sample (``evaluate``'s rows: the sample, its answer,
    IoU, matched, missed and extra boxes), each ``image`` made absolute so that the file is read
    wherever it lies (the studio draws them); ``model`` recorded on each line when given."""
    with atomic_write(path) as f:
        for row in rows:
            line = {**row, "image": str(image_path(row, data_path)), **({"model": model} if model else {})}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return Path(path)


def verdict(row: dict) -> str:
    """One line on an answer: its first box's IoU, the true boxes found and missed, the extra ones,
    "no target" where the sample or the answer names none, and the answer's boxes that are none
    (no area: ``boxes.has_area``), listed as given."""
    if not row["read"]:
        return f"parse failure: {row['error']}"
    invalid = [b for b in row["pred_boxes"] if not boxes.has_area(b)]
    said = "; invalid box(es), no area: " + ", ".join(_shown(b) for b in invalid) if invalid else ""
    return _verdict(row) + said


def _shown(box: list[float]) -> str:
    return "[" + ", ".join(f"{round(v, 1):g}" for v in box) + "]"


def _verdict(row: dict) -> str:
    n_true, n_found, n_extra = len(row["true_boxes"]), len(row["matched"]), len(row["extra"])
    if not n_true:
        return "no target, answered no target" if row["no_target"] else f"no target, {n_extra} extra box(es)"
    if row["no_target"]:
        return f"answered no target, {n_true} missed"
    parts = [f"IoU {row['iou']:.3f}", f"{n_found} of {n_true} true box(es) found"]
    if n_extra:
        parts.append(f"{n_extra} extra")
    return ", ".join(parts)


def _card(row: dict, data_path, out_dir: Path, png_name: str) -> str:
    image = load_image(image_path(row, data_path), (row["width"], row["height"]))
    with atomic_write(out_dir / png_name, "wb") as f:
        draw_answer(image, row["true_boxes"], row["pred_boxes"], row["matched"]).save(
            f, format="PNG", pnginfo=png_info(GALLERY_DRAWN_BY))
    e = html.escape
    return (
        f'<div class=card><img src="{e(png_name)}"><p><b>{e(str(row["phrase"]))}</b></p>'
        f"<p>{e(verdict(row))} &middot; {e(str(row['id']))}</p><pre>{e(row['raw'])}</pre></div>"
    )


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.card {{ width: 340px; border: 1px solid #ccc; padding: 6px; }}
.card img {{ max-width: 320px; image-rendering: pixelated; }}
pre {{ white-space: pre-wrap; word-break: break-all; background: #f4f4f4; font-size: 11px; }}
</style></head><body>
<h1>{n} samples: <span style="color:#00c800">true box found</span>,
<span style="color:#006eff">true box missed</span>, <span style="color:#e60000">predicted box matched</span>,
<span style="color:#d200d2">predicted box extra</span> (matched one to one at IoU &ge; 0.5),
<span style="color:#ff8c00">predicted "box" with no area, dashed: invalid</span></h1>
{body}
</body></html>
"""


# --------------------------------------------------------------------------------------------
# The eval command


def run_eval(model: str, data, limit: int | None = None, out=None, gallery=None, compare: str | None = None,
             batch_size: int = InferSettings.batch_size, max_pixels: int | None = None,
             min_pixels: int | None = None, device: str = InferSettings.device,
             max_new_tokens: int = InferSettings.max_new_tokens, protocol: str = protocols.DEFAULT_PROTOCOL,
             compile: bool = InferSettings.compile, samples_out=None) -> dict:
    """Evaluate ``model`` (and ``compare`` on the same samples) on a canonical JSONL file, print
    the metrics (and the published figure beside them where one matches: protocols.published), and
    write report.json / the gallery / every answer (``samples_out``: write_rows, each model's lines
    named by it) when asked. Returns the report."""
    from groundtune.models.loading import resolve

    samples = read_samples(data)
    names = [model] + ([compare] if compare else [])
    for name in names:  # every model there before the first is evaluated, not found missing after it
        resolve(name)
    reports, answers = [], []
    for i, name in enumerate(names):
        gm = infer.load(name, device, min_pixels, max_pixels, who="eval", compile=compile)
        report, rows = evaluate(gm, samples, data, batch_size=batch_size, limit=limit, max_new_tokens=max_new_tokens,
                                protocol=protocol)
        beside = published_beside(report, samples[:limit] if limit is not None else samples, data)
        if beside:
            report["published"] = beside
        reports.append(report)
        if gallery:
            folder = Path(gallery) if i == 0 else Path(gallery) / "compare"
            print(f"gallery of {name}: {write_gallery(rows, data, folder)}")
        answers += [{**row, "model": name} for row in rows] if samples_out else []
        del gm  # free the first model's memory before loading the second
    print_table(reports)
    for report in reports:
        if "published" in report:
            row = report["published"]
            print(f"{report['model']}, {protocols.BENCHMARKS[row['benchmark']]} {row['split']}, protocol "
                  f"{row['protocol']}: Acc@0.5 {row['measured_acc@0.5']:.1f} measured, {row['acc@0.5']:.1f} "
                  f"published ({row['source']})")
    result = reports[0] if len(reports) == 1 else {"models": reports}
    if out:
        with atomic_write(out) as f:
            f.write(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    if samples_out:
        print(f"wrote {write_rows(answers, data, samples_out)}")
    return result


def written_by_eval(path: Path) -> bool:
    """Whether ``path`` holds a report `groundtune eval --out` wrote: it may be replaced by the next
    one without --overwrite. A report is some KB; a file of more than 64 MB is none."""
    if path.stat().st_size > 2**26:
        return False
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: not UTF-8, not JSON
        return False
    reports = report.get("models") if isinstance(report, dict) and "models" in report else [report]
    return (isinstance(reports, list) and bool(reports)
            and all(isinstance(r, dict) and {"model", "protocol", "definitions"} <= r.keys() for r in reports))


def written_by_eval_samples(path: Path) -> bool:
    """Whether ``path`` holds answers `groundtune eval --samples` wrote (``write_rows``): its first
    line one of them."""
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline(2**20))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(first, dict) and {"model", "pred_boxes", "true_boxes"} <= first.keys()


def print_table(reports: list[dict]) -> None:
    """Two tables, one row per group (overall, each split, each source) and model: the single-target
    metrics (over the samples with a target), then the set metrics with the boxes missed and extra
    and the no-target samples (AP columns when the answers were scored)."""
    from rich.console import Console

    # Logs and pipes get a wide table instead of rich's 80 columns, so long model names stay whole.
    console = Console(width=None if sys.stdout.isatty() else 160)
    single = [("n target", "n_target", "{}")] + [(HEADERS[m], m, "{:.3f}") for m in METRICS]
    console.print(_table(reports, f"grounding eval on {reports[0]['data']}: first box vs the best true box, "
                                  "samples with a target", single))
    sets = ([("n", "n", "{}"), ("no target", "n_no_target", "{}")]
            + [(HEADERS[m], m, "{:.3f}") for m in SET_METRICS]
            + [("missed", "missed@0.5", "{}"), ("extra", "extra@0.5", "{}")]
            + [(HEADERS[m], m, "{:.3f}") for m in AP_METRICS if any(m in r for r in reports)])
    console.print(_table(reports, "sets: boxes matched one to one at IoU >= 0.5 (missed: true boxes unmatched, "
                                  "extra: predicted boxes unmatched)", sets))


def _table(reports: list[dict], title: str, columns: list[tuple[str, str, str]]):
    """A rich table of ``columns`` (header, report key, format) per group and model."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("group")
    if len(reports) > 1:
        table.add_column("model")
    for header, _, _ in columns:
        table.add_column(header, justify="right")
    groups = [("overall", lambda r: r)]
    for key in ("by_split", "by_source"):
        for value in reports[0][key]:
            groups.append((f"{key[3:]}={value}", lambda r, key=key, value=value: r[key].get(value)))
    for label, pick in groups:
        for report in reports:
            metrics = pick(report)
            cells = [label] + ([report["model"]] if len(reports) > 1 else [])
            cells += [fmt.format(metrics[key]) if metrics and metrics.get(key) is not None else "-"
                      for _, key, fmt in columns]
            table.add_row(*cells)
    return table
