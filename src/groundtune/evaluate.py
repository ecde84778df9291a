"""Grounding evaluation: Acc@0.5, Acc@0.75, Acc@0.5:0.95, mIoU and parse-failure rate, overall and
per split and source, plus an HTML gallery of the worst and a sample of the best answers.

    groundtune eval --model runs/sft --data data/synth/val.jsonl --out report.json --gallery gallery/
    groundtune eval --model runs/rl --compare runs/sft --data val.jsonl

A sample counts as a hit when the IoU of the model's FIRST box with any of the true boxes reaches
the threshold (RefCOCO's Acc@0.5 uses >= 0.5). An answer without a usable box is a parse failure
and scores IoU 0: it is never replaced by a guessed box. A box-head model (``head: box``) answers
each phrase with exactly one box; the report counts the samples that have several true boxes.
"""

from __future__ import annotations

import html
import json
import random
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from groundtune import boxes, infer
from groundtune.config import InferSettings
from groundtune.data.images import load_image
from groundtune.data.records import atomic_write, image_path, read_samples, sample_boxes
from groundtune.data.refgen import MODEL_FILTER_IOU

THRESHOLDS = [round(0.5 + 0.05 * i, 2) for i in range(10)]  # 0.5, 0.55, ..., 0.95 (COCO's)
METRICS = ["acc@0.5", "acc@0.75", "acc@0.5:0.95", "miou", "parse_fail_rate"]
HEADERS = {"acc@0.5": "Acc@.5", "acc@0.75": "Acc@.75", "acc@0.5:0.95": "Acc@.5:.95", "miou": "mIoU",
           "parse_fail_rate": "parse fail"}
TRUE_COLOUR = (0, 200, 0)
PRED_COLOUR = (230, 0, 0)


def score(pred_box: list[float] | None, true_boxes: list[list[float]]) -> dict:
    """IoU of the predicted box with the best-matching true box (0 when there is no prediction)."""
    best = boxes.best_iou(pred_box, true_boxes)
    return {"iou": best, "hit@0.5": best >= 0.5, "hit@0.75": best >= 0.75}


def _metrics(rows: list[dict]) -> dict:
    n = len(rows)
    if n == 0:
        return {"n": 0, **{m: None for m in METRICS}}
    ious = [r["iou"] for r in rows]
    acc = {t: sum(i >= t for i in ious) / n for t in THRESHOLDS}
    return {
        "n": n,
        "acc@0.5": acc[0.5],
        "acc@0.75": acc[0.75],
        "acc@0.5:0.95": sum(acc.values()) / len(THRESHOLDS),
        "miou": sum(ious) / n,
        "parse_fail_rate": sum(r["pred_bbox"] is None for r in rows) / n,
    }


def _group(rows: list[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r.get(key) if r.get(key) is not None else "-"), []).append(r)
    return dict(sorted(groups.items()))


def summarise(rows: list[dict]) -> dict:
    """Metrics over scored rows (each needs ``iou`` and ``pred_bbox``), overall and per split/source."""
    return {
        **_metrics(rows),
        "by_split": {k: _metrics(g) for k, g in _group(rows, "split").items()},
        "by_source": {k: _metrics(g) for k, g in _group(rows, "source").items()},
    }


def evaluate(gm, samples: list[dict], data_path, batch_size: int = InferSettings.batch_size,
             limit: int | None = None, progress: bool = True, max_new_tokens: int = InferSettings.max_new_tokens,
             predictions: list | None = None) -> tuple[dict, list[dict]]:
    """Predict (greedy) and score every sample; returns (report, one row per sample). The report
    records what was measured and how: model, data, family, pixel budget, prompt, decoding.

    Images are read in worker processes one batch at a time (``infer.predict_records``), so a large
    eval set never sits in memory at once. ``predictions``: the samples' predictions made already
    (by several training ranks, each its share, with these settings), scored instead.
    """
    samples = samples[:limit] if limit is not None else samples
    if not samples:
        raise ValueError(f"{data_path}: no samples to evaluate")
    preds = predictions if predictions is not None else infer.predict_records(
        gm, samples, data_path, batch_size, max_new_tokens, progress="eval" if progress else None)
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
            "pred_bbox": pred.bbox,
            **score(pred.bbox, true),
            "raw": pred.raw,
            "error": pred.error,
            "split": sample.get("split"),
            "source": sample.get("source"),
        })
    box_head = gm.metadata()["head"] == "box"
    report = {
        "model": gm.source,
        "data": str(data_path),
        "family": gm.family,
        "resize": gm.resize.to_dict(),
        "prompt": gm.prompt,
        "head": "box" if box_head else "text",
        "decoding": ({"box_head": "one forward pass, one box per phrase"} if box_head
                     else infer.Decoding.greedy(max_new_tokens).to_dict()),
        "several_true_boxes": sum(len(r["true_boxes"]) > 1 for r in rows),
        **summarise(rows),
    }
    return report, rows


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
    """A copy of the original image with the true boxes in green and the predicted box in red.
    Small images are enlarged (nearest neighbour) so a 2 px outline does not hide the object."""
    scale = max(1, 320 // max(image.size))
    out = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)
    draw = ImageDraw.Draw(out)
    width = max(2, max(out.size) // 200)
    for box, colour in [(b, TRUE_COLOUR) for b in true_boxes] + ([(pred_box, PRED_COLOUR)] if pred_box else []):
        draw.rectangle([v * scale for v in box], outline=colour, width=width)
    return out


def write_gallery(rows: list[dict], data_path, out_dir, n_worst: int = 24, n_best: int = 12, seed: int = 0) -> Path:
    """Draw the worst answers (parse failures first, then lowest IoU) and a random sample of the
    hits at IoU >= 0.5, and write ``index.html`` listing them; returns the index path."""
    out_dir = Path(out_dir)
    ranked = sorted(range(len(rows)), key=lambda i: (rows[i]["pred_bbox"] is not None, rows[i]["iou"]))
    worst = ranked[:n_worst]
    hits = [i for i in ranked[n_worst:] if rows[i]["hit@0.5"]]
    best = random.Random(seed).sample(hits, min(n_best, len(hits)))
    sections = []
    for title, name, chosen in [("Worst", "worst", worst), ("Best (random sample of hits)", "best", best)]:
        cards = [_card(rows[i], data_path, out_dir, f"{name}_{k:03d}.png") for k, i in enumerate(chosen)]
        sections.append(f"<h2>{title}: {len(chosen)}</h2>\n<div class=grid>\n" + "\n".join(cards) + "\n</div>")
    index = out_dir / "index.html"
    with atomic_write(index) as f:
        f.write(_PAGE.format(n=len(rows), body="\n".join(sections)))
    return index


def _card(row: dict, data_path, out_dir: Path, png_name: str) -> str:
    image = load_image(image_path(row, data_path), (row["width"], row["height"]))
    with atomic_write(out_dir / png_name, "wb") as f:
        draw_boxes(image, row["true_boxes"], row["pred_bbox"]).save(f, format="PNG")
    verdict = f"IoU {row['iou']:.3f}" if row["pred_bbox"] is not None else f"parse failure: {row['error']}"
    e = html.escape
    return (
        f'<div class=card><img src="{e(png_name)}"><p><b>{e(str(row["phrase"]))}</b></p>'
        f"<p>{e(verdict)} &middot; {e(str(row['id']))}</p><pre>{e(row['raw'])}</pre></div>"
    )


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>groundtune eval gallery</title>
<style>
body {{ font-family: sans-serif; margin: 1em; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 12px; }}
.card {{ width: 340px; border: 1px solid #ccc; padding: 6px; }}
.card img {{ max-width: 320px; image-rendering: pixelated; }}
pre {{ white-space: pre-wrap; word-break: break-all; background: #f4f4f4; font-size: 11px; }}
</style></head><body>
<h1>{n} samples: <span style="color:#00c800">true box</span>, <span style="color:#e60000">predicted box</span></h1>
{body}
</body></html>
"""


# --------------------------------------------------------------------------------------------
# The eval command


def run_eval(model: str, data, limit: int | None = None, out=None, gallery=None, compare: str | None = None,
             batch_size: int = InferSettings.batch_size, max_pixels: int | None = None,
             min_pixels: int | None = None, device: str = InferSettings.device,
             max_new_tokens: int = InferSettings.max_new_tokens) -> dict:
    """Evaluate ``model`` (and ``compare`` on the same samples) on a canonical JSONL file, print
    the metrics, and write report.json / the gallery when asked. Returns the report."""
    from groundtune.models.loading import resolve

    samples = read_samples(data)
    names = [model] + ([compare] if compare else [])
    for name in names:  # every model there before the first is evaluated, not found missing after it
        resolve(name)
    reports = []
    for i, name in enumerate(names):
        gm = infer.load(name, device, min_pixels, max_pixels, who="eval")
        report, rows = evaluate(gm, samples, data, batch_size=batch_size, limit=limit, max_new_tokens=max_new_tokens)
        reports.append(report)
        if gallery:
            folder = Path(gallery) if i == 0 else Path(gallery) / "compare"
            print(f"gallery of {name}: {write_gallery(rows, data, folder)}")
        del gm  # free the first model's memory before loading the second
    print_table(reports)
    result = reports[0] if len(reports) == 1 else {"models": reports}
    if out:
        with atomic_write(out) as f:
            f.write(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
    return result


def print_table(reports: list[dict]) -> None:
    """One row per group (overall, each split, each source) and model, one column per metric."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"grounding eval on {reports[0]['data']}")
    table.add_column("group")
    if len(reports) > 1:
        table.add_column("model")
    table.add_column("n", justify="right")
    for m in METRICS:
        table.add_column(HEADERS[m], justify="right")
    groups = [("overall", lambda r: r)]
    for key in ("by_split", "by_source"):
        for value in reports[0][key]:
            groups.append((f"{key[3:]}={value}", lambda r, key=key, value=value: r[key].get(value)))
    for label, pick in groups:
        for report in reports:
            metrics = pick(report)
            cells = [label] + ([report["model"]] if len(reports) > 1 else [])
            cells.append(str(metrics["n"]) if metrics else "-")
            cells += [f"{metrics[m]:.3f}" if metrics and metrics[m] is not None else "-" for m in METRICS]
            table.add_row(*cells)
    # Logs and pipes get a wide table instead of rich's 80 columns, so long model names stay whole.
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    for report in reports:
        if report.get("head") == "box" and report.get("several_true_boxes"):
            print(f"{report['model']}: a box head gives one box per phrase; {report['several_true_boxes']} samples "
                  "have several true boxes, and its box is a hit when it matches any of them")
