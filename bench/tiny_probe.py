"""Does the vision tower's output say what colour and kind of shape each image token shows?

A least-squares linear probe, trained on 70% of the image tokens that hold a shape's centre and
scored on the rest, at two places: the merger's input (the tower's last block, each token's four
patches normalised, what the merger's MLP reads) and the merged tokens (what the language model
reads). If a model never picks the named shape among several, this tells whether the information
is missing in the tower, lost in the merger, or there and unused by the language model. Chance is
0.25 for colour (four) and 0.33 for kind (three).

And how far each stage of the tower moves when only the shapes' colours change, against when only
their kinds change (``moved_by``): synth's colour-task scenes (2-3 shapes of one kind) drawn three
times, as they are, with every colour swapped for the next of the palette, and with every kind
swapped for the next; at each stage (the pixels as the tower reads them, the patch embedding, each
block, the merged tokens) the change summed over all tokens over the features' summed size. A probe
reads a small change as well as a large one; a language model behind RMS norms sees what share of
its input a colour moves.

And whether the language model brings the phrase's colour word, and its kind word, to where the
answer starts (``answer_start``): the same probe on each layer's hidden state at the prompt's last
position, over colour-task phrases ("the red circle", "the red shape"). Layer 0, the embedding of
the prompt's last token (the same for every phrase), scores the most common class's share: the
baseline (~0.25 for colour, ~0.5 for kind: half the phrases say "shape"). A random network mixes
every token into every position, so high scores mean little there; a trained one keeps what it
uses. A model cannot pick a shape by a colour its answer never sees asked for.

    python bench/tiny_probe.py MODEL [MODEL ...] --n 600 [--out probe.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from groundtune.cli.flags import positive_int
from groundtune.data.synth import DEFAULT_PALETTE, Palette, make_sample, make_scene
from groundtune.models.loading import load_model
from groundtune.models.qwen import IGNORE_INDEX
from groundtune.train.batches import encode_sample

sys.path.insert(0, str(Path(__file__).parent))
from provenance import measure_models


def measure(model: str, n: int) -> dict:
    """Every measure of this script on one model, loaded once."""
    gm = load_model(model, device="cpu", dtype="fp32")
    return {**probe(gm, n), "moved_by": moved_by(gm, n), "answer_start": answer_start(gm, n)}


def probe(gm, n: int) -> dict:
    colours, kinds = list(DEFAULT_PALETTE.colours), list(DEFAULT_PALETTE.shapes)
    merger = gm.model.model.visual.merger
    seen = {}  # the merger MLP's input and output, in the tower's window order
    hook = merger.mlp.register_forward_hook(lambda _m, args, out: seen.update(mlp_in=args[0], mlp_out=out))
    features = {"before_merger": [], "merged": []}
    colour_labels, kind_labels = [], []
    for i in range(n):
        image, record = make_sample(5, i, task="multi")
        scene = make_scene(5, i, task="multi")
        enc = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record)
        with torch.no_grad():
            out = gm.model.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"])
        tokens = getattr(out, "pooler_output", out)
        tokens = torch.cat(list(tokens)) if isinstance(tokens, (list, tuple)) else tokens
        # the tower puts its tokens back in reading order after the merger: find each one's row
        window_row = torch.cdist(tokens.float(), seen["mlp_out"].float()).argmin(1)
        cols = int(enc["image_grid_thw"][0, 2]) // 2
        cell = image.width / cols  # pixels per merged token (the canvas is not resized at 112 px)
        for shape in scene.shapes:
            token = int(shape.cy // cell) * cols + int(shape.cx // cell)
            features["merged"].append(tokens[token].float().numpy())
            features["before_merger"].append(seen["mlp_in"][window_row[token]].float().numpy())
            colour_labels.append(colours.index(shape.colour))
            kind_labels.append(kinds.index(shape.kind))
    hook.remove()
    result = {"tokens": len(colour_labels)}
    for place, rows in features.items():
        result[place] = {"colour": probe_accuracy(rows, colour_labels, len(colours)),
                         "kind": probe_accuracy(rows, kind_labels, len(kinds))}
    return result


def moved_by(gm, n: int) -> dict:
    visual = gm.model.model.visual
    stages = {"patch_embed": visual.patch_embed, **{f"block{i}": b for i, b in enumerate(visual.blocks)},
              "merged": visual.merger}
    seen = {}
    hooks = [module.register_forward_hook(lambda _m, _args, out, name=name: seen.update({name: out}))
             for name, module in stages.items()]
    colours, kinds = DEFAULT_PALETTE.colours, DEFAULT_PALETTE.shapes
    names = list(colours)
    swapped = {"colour": Palette(colours={c: colours[names[(i + 1) % len(names)]] for i, c in enumerate(names)},
                                 shapes=kinds),
               "kind": Palette(colours=colours, shapes=kinds[1:] + kinds[:1])}

    def features(index: int, palette: Palette) -> dict:
        image, record = make_sample(5, index, task="colour", palette=palette)
        enc = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record)
        with torch.no_grad():
            visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"])
        return {"pixels": enc["pixel_values"], **{k: v[0] if isinstance(v, tuple) else v for k, v in seen.items()}}

    moved = {name: dict.fromkeys(swapped, 0.0) for name in ["pixels", *stages]}
    size = dict.fromkeys(moved, 0.0)
    for index in range(n):
        base = features(index, DEFAULT_PALETTE)
        for name, x in base.items():
            size[name] += float(x.norm(dim=-1).sum())
        for cue, palette in swapped.items():
            other = features(index, palette)
            for name, x in base.items():
                moved[name][cue] += float((x - other[name]).norm(dim=-1).sum())
    for hook in hooks:
        hook.remove()
    return {name: {cue: round(v / size[name], 4) for cue, v in by_cue.items()} for name, by_cue in moved.items()}


def answer_start(gm, n: int) -> dict:
    colours, kinds = list(DEFAULT_PALETTE.colours), [*DEFAULT_PALETTE.shapes, "shape"]
    layers, colour_labels, kind_labels = {}, [], []
    for index in range(n):
        image, record = make_sample(7, index, task="colour")
        enc = encode_sample(gm.processor, gm.family, gm.resize, gm.prompt, image, record)
        end = int((enc["labels"] != IGNORE_INDEX).nonzero().min())  # the prompt: all before the answer
        with torch.no_grad():
            out = gm.model(input_ids=enc["input_ids"][None, :end], pixel_values=enc["pixel_values"],
                           image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=enc["mm_token_type_ids"][None, :end],
                           output_hidden_states=True)
        for layer, hidden in enumerate(out.hidden_states):  # 0: the embeddings
            layers.setdefault(f"layer{layer}", []).append(hidden[0, -1].float().numpy())
        _, colour, kind = record["phrase"].split()  # "the red circle", "the red shape"
        colour_labels.append(colours.index(colour))
        kind_labels.append(kinds.index(kind))
    return {layer: {"colour": probe_accuracy(rows, colour_labels, len(colours)),
                    "kind": probe_accuracy(rows, kind_labels, len(kinds))} for layer, rows in layers.items()}


def probe_accuracy(rows: list[np.ndarray], labels: list[int], classes: int) -> float:
    """A least-squares linear probe fitted on the first 70% of the rows, scored on the rest."""
    x = np.c_[np.array(rows), np.ones(len(rows))]
    split = int(0.7 * len(x))
    w = np.linalg.lstsq(x[:split], np.eye(classes)[labels][:split], rcond=None)[0]
    return round(float((np.argmax(x[split:] @ w, 1) == np.array(labels[split:])).mean()), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--n", type=positive_int, default=600, help="scenes for each measure (2-3 shapes each)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    measure_models(parser, args.models, lambda model: measure(model, args.n), args.out)


if __name__ == "__main__":
    main()
