"""ms-swift's `swift sft`, run by its own entry point with a step timer added, for bench/sft_speed.py's
`swift` variant. It runs in a process whose packages are ms-swift's (its pinned datasets and trl
differ from groundtune's): sft_speed.py starts it with --peer-site on PYTHONPATH.

    python bench/peer_swift.py --out times.json --cap-gib 24 -- --model DIR --dataset FILE ...

Everything after `--` goes to `swift sft` unchanged. The timer is registered the way ms-swift takes
callbacks (`swift.callbacks.callbacks_map`, named by `--callbacks`), so the trainer, its data
pipeline and its settings are ms-swift's own. Writes the wall time of each optimizer step (the GPU
synchronised), the logged losses, the peak allocated GPU memory and the versions it ran with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from gpu_cap import cap_gpu_memory  # bench/, the script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file for the step times, losses and peak memory")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap (a 24 GB card)")
    parser.add_argument("swift_args", nargs=argparse.REMAINDER, help="-- then the arguments of `swift sft`")
    args = parser.parse_args()
    swift_args = args.swift_args[1:] if args.swift_args[:1] == ["--"] else args.swift_args
    if "--model" not in swift_args[:-1]:
        parser.error("the arguments of `swift sft` after -- must name the model: --model DIR")
    cap_gpu_memory(args.cap_gib)

    from swift.callbacks import TrainerCallback, callbacks_map
    from swift.pipelines import sft_main

    times: list[float] = []
    states = []

    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            times.append(-now())

        def on_step_end(self, args, state, control, **kwargs):
            times[-1] += now()

        def on_train_end(self, args, state, control, **kwargs):
            states.append(state)

    callbacks_map["groundtune_step_timer"] = StepTimer
    _template_token_ids(swift_args[swift_args.index("--model") + 1])
    sft_main([*swift_args, "--callbacks", "groundtune_step_timer"])
    history = states[-1].log_history if states else []
    with open(args.out, "w") as f:
        json.dump({"step_s": times, "losses": [r["loss"] for r in history if "loss" in r],
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
                   "argv": swift_args, "versions": _versions()}, f)


def _versions() -> dict:
    """The packages this process trained with: ms-swift's folder, not the bench's environment (whose
    versions the bench's own stamp records)."""
    from importlib import metadata

    return {name: metadata.version(name) for name in ("ms-swift", "transformers", "trl", "datasets", "peft", "torch")}


def _template_token_ids(model_dir: str) -> None:
    """ms-swift's Qwen2-VL/2.5-VL template finds the image and video tokens by Qwen's vocabulary ids
    (151655, 151656), written in the class; the bench's random architectures speak the tiny model's
    tokenizer, whose ids differ, and there the image would stay ONE token instead of its hundreds.
    The template takes the model's own ids (for a real Qwen checkpoint, the same numbers)."""
    from swift.template.templates.qwen import Qwen2VLTemplate
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    Qwen2VLTemplate.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    Qwen2VLTemplate.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")


if __name__ == "__main__":
    sys.exit(main())
