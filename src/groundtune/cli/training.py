"""`groundtune plan`, `train`, `rl` and `quickstart`: a run planned, made and resumed."""

from __future__ import annotations

import argparse
import json
import os

from groundtune.cli.flags import Formatter, positive_int
from groundtune.errors import UsageError
from groundtune.runs import RunFolder


def _plan(args: argparse.Namespace) -> int:
    from groundtune import plan
    from groundtune.config import TrainConfig, file_settings, load_config, preset_path

    if args.gpus < 1:
        raise UsageError(f"groundtune plan: --gpus {args.gpus}: expected 1 or more")
    given_card = args.gpu or args.memory_gib is not None
    card = plan.card(args.gpu, args.memory_gib) if given_card else plan.card(plan.DEFAULT_CARD)
    if args.data and not os.path.isfile(args.data):
        what = "a folder, not a JSONL file" if os.path.isdir(args.data) else "no such file"
        raise UsageError(f"groundtune plan: --data {args.data}: {what}")
    path = preset_path(args.config)
    given = dict(o.split("=", 1) for o in args.overrides if "=" in o)
    # the run's own data where the file or the command line names it (its image sizes are planned)
    named = given.get("train_data") or file_settings(path).get("train_data")
    overrides = list(args.overrides) + ([] if named else [f"train_data={plan.PLAN_TRAIN_DATA}"])
    cfg = load_config(TrainConfig, path, overrides)
    result = plan.plan_run(cfg, card, args.data, args.gpus)  # batch_size=auto: planned at the largest that fits
    if args.json:
        print(json.dumps({**result.plan.to_json(), "model": result.model,
                          "suggestions": [{"change": x.change, "peak_gib": round(x.plan.peak_gib, 2),
                                           "samples_per_s": x.plan.samples_per_s and round(x.plan.samples_per_s, 2)}
                                          for x in result.suggestions]}, indent=1))
    else:
        print(plan.render(result, args.explain))
    return 0


def add_plan(sub: argparse._SubParsersAction) -> None:
    from groundtune.plan import DEFAULT_CARD

    p = sub.add_parser(
        "plan",
        help="will a training run fit a GPU, how fast will it go, and what to change if not (no model loaded)",
        description="Predict a run's peak GPU memory (weights, adapters and optimizer, activations, the vision\n"
        "tower's pass), whether it fits the card, the largest batch_size that does, its samples/s and time\n"
        "per epoch, and, when it does not fit, the changes that make it fit ranked by speed. From the\n"
        "model's shape, the settings and the data's image sizes, with constants fitted from real steps on\n"
        "an H200 (bench/results/plan_check.json); speed scaled to the card by its bf16 rate and bandwidth.\n"
        "Nothing is loaded and no GPU is needed: it answers in about a second.\n\n"
        "examples:\n"
        "  groundtune plan qwen2.5-vl-7b-lora-24gb --gpu rtx3090\n"
        "  groundtune plan qwen2.5-vl-3b-lora-24gb batch_size=128 --memory-gib 16 --data train.jsonl\n"
        "  groundtune plan qwen2.5-vl-7b-qlora --gpu l4 --json\n"
        "  groundtune plan my.yaml distributed=fsdp2 --gpu a100-80gb --gpus 8 --explain\n\n"
        "key=value settings go before the flags.",
        formatter_class=Formatter,
    )
    p.add_argument("config", metavar="CONFIG", help="a YAML file or a preset name (as groundtune train takes)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings over the file's, as in train")
    p.add_argument("--gpu", metavar="NAME", help="the card, e.g. rtx3090, rtx4090, l4, a100-80gb, h100 (default: "
                   f"{DEFAULT_CARD} unless --memory-gib is given); an unknown name lists the known ones")
    p.add_argument("--memory-gib", type=float, help="the card's memory in GiB (with --gpu: that card with this "
                   "memory; alone: a card of this memory with the reference card's speeds)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the run (per-GPU memory under distributed=fsdp2/"
                   "zero2/zero3 shards; samples/s of all of them)")
    p.add_argument("--data", help="canonical JSONL file whose image sizes (width, height) and boxes decide the "
                   "tokens a sample (default: the config's train_data file, else COCO-sized images)")
    p.add_argument("--json", action="store_true", help="print JSON (peak_gib, fits, max_batch_size, "
                   "samples_per_s, epoch_s, parts_gib, suggestions, ...) for scripts")
    p.add_argument("--explain", action="store_true", help="also print the model's assumptions and the card's "
                   "sources")
    p.set_defaults(handler=_plan)


def _train(args: argparse.Namespace) -> int:
    """`groundtune train` and `groundtune rl`: the same command line, each with its settings class."""
    from groundtune.config import RLConfig, TrainConfig, load_config, preset_path

    cls = RLConfig if args.command == "rl" else TrainConfig
    if args.resume:
        # a corrected data file of the same records may be named (train_data=..., eval_data=...)
        given = [args.config] if args.config and "=" in args.config else []
        if args.config and not given:
            raise UsageError(f"groundtune {args.command} --resume RUN takes no config file: the run's saved "
                             f"{RunFolder(args.resume).config.name} is used, so the resumed run is the same run")
        start = dict(resume=args.resume, resume_overrides=tuple(given + args.overrides))
    else:
        if not args.config:
            raise UsageError(f"groundtune {args.command}: give a CONFIG.yaml (or a preset name) or --resume RUN")
        start = dict(cfg=load_config(cls, preset_path(args.config), args.overrides))  # settings first: fast
    if args.command == "rl":
        from groundtune.train.rl import rl as run_fn
    else:
        from groundtune.train.sft import train as run_fn
    from groundtune.train.distributed import from_environment

    run = run_fn(**start)
    if from_environment().main:  # under torchrun, rank 0 speaks for the run
        print(f"run folder: {run}  (model: {RunFolder(run).model})")
    return 0


def add_train(sub: argparse._SubParsersAction) -> None:
    from groundtune.config import TrainConfig

    _add_run_command(
        sub, "train", TrainConfig, "supervised fine-tuning (LoRA / QLoRA / full)",
        "Fine-tune a model on canonical JSONL.",
        "  groundtune train quickstart max_steps=500\n"
        "  groundtune train qwen2.5-vl-3b-lora-24gb train_data=train.jsonl eval_data=val.jsonl\n"
        "  groundtune train my.yaml model=Qwen/Qwen2.5-VL-7B-Instruct method=qlora lr=1e-4\n"
        "  groundtune train --resume runs/sft        # after Ctrl-C, SIGTERM, `touch runs/sft/STOP` or a "
        "crash\n")


def add_rl(sub: argparse._SubParsersAction) -> None:
    from groundtune.config import RLConfig

    _add_run_command(
        sub, "rl", RLConfig, "reinforcement learning with the box's IoU as reward (GRPO / REINFORCE)",
        "Improve a model (an SFT run's LoRA adapter, or a new one) by sampling answers to\n"
        "prompts and rewarding each by its box's IoU with the truth.",
        "  groundtune rl quickstart-rl model=quickstart/run\n"
        "  groundtune rl my.yaml model=runs/sft train_data=train.jsonl eval_data=val.jsonl kl_coef=0.04\n"
        "  groundtune rl --resume runs/rl\n")


def _add_run_command(sub: argparse._SubParsersAction, name: str, cls, help_text: str, what: str,
                     examples: str) -> None:
    """A command that makes a run folder from ``cls``'s settings (train, rl): CONFIG, key=value
    overrides or --resume RUN, and every setting with its default and help in --help."""
    from groundtune.config import PRESETS, describe

    presets = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
    p = sub.add_parser(
        name,
        help=help_text,
        description=f"{what} CONFIG is a YAML file or a shipped preset\n({presets}); any setting can be "
        "overridden as key=value.\n\nexamples:\n" + examples + "\n"
        "The run folder (out_dir) gets model/ (use it with eval/predict), checkpoints/, metrics.jsonl\n"
        f"and tb/ (TensorBoard).\n\nsettings ({cls.__name__}) and their defaults:\n" + describe(cls),
        formatter_class=Formatter,
    )
    p.add_argument("config", nargs="?", help="YAML file or preset name")
    p.add_argument("overrides", nargs="*", help="key=value settings that override the file")
    p.add_argument("--resume", metavar="RUN", help="continue the run in this folder exactly where it stopped "
                   "(train_data=/eval_data= may name a corrected file of the same records)")
    p.set_defaults(handler=_train)


def _quickstart(args: argparse.Namespace) -> int:
    from groundtune.quickstart import quickstart

    quickstart(args.out, n_train=args.n_train, n_eval=args.n_eval, overrides=tuple(args.overrides))
    return 0


def add_quickstart(sub: argparse._SubParsersAction) -> None:
    from groundtune.quickstart import N_EVAL, N_TRAIN, OUT

    p = sub.add_parser(
        "quickstart",
        help="the first run: the pre-trained tiny model, LoRA-tuned to a new task variant (CPU, minutes)",
        description="Make a synthetic set of a variant the built-in tiny model was not trained on (its shapes\n"
        "on a dark background), evaluate the tiny model on it, fine-tune it with LoRA (preset `quickstart`),\n"
        "evaluate again and print both, with a gallery. Re-running resumes an unfinished run.\n\n"
        "examples:\n  groundtune quickstart\n  groundtune quickstart --out /tmp/qs max_steps=300",
        formatter_class=Formatter,
    )
    p.add_argument("overrides", nargs="*", help="key=value training settings (see groundtune train --help)")
    p.add_argument("--out", default=OUT, help="folder for data/, run/, report.json and gallery/")
    p.add_argument("--n-train", type=positive_int, default=N_TRAIN, help="synthetic training samples of the variant")
    p.add_argument("--n-eval", type=positive_int, default=N_EVAL, help="synthetic held-out samples (another seed)")
    p.set_defaults(handler=_quickstart)

