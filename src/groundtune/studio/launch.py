"""The Launch tab: a form built from the training settings themselves (each field's default and
help, as `groundtune train --help` lists them), `groundtune plan`'s verdict for the chosen card,
then a real `groundtune train` / `groundtune rl` process; a run is stopped with its STOP file and
resumed with `--resume`.

Every path setting is held inside the work folder and handed to the process absolute, so the plan
made here and the run started there read the same files.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from groundtune.config import (
    PRESETS,
    RLConfig,
    TrainConfig,
    file_settings,
    load_config,
    settings_of,
)
from groundtune.errors import ConfigError
from groundtune.runs import RunFolder, is_run
from groundtune.studio.safety import Refusal

COMMANDS = {"train": TrainConfig, "rl": RLConfig}
DEFAULT_PRESET = {"train": "quickstart", "rl": "quickstart-rl"}
PATH_SETTINGS = ("train_data", "eval_data", "out_dir", "deepspeed_config")  # files and folders a run reads or writes
NOT_PATHS = ("synth:", "hf:")  # data named without a file of the work folder


def _cls(args: dict):
    command = args.get("command") or "train"
    if command not in COMMANDS:
        raise Refusal(f"command {command!r}: expected train or rl")
    return COMMANDS[command]


def _preset(cls, args: dict) -> tuple[str, dict]:
    name = args.get("preset") or DEFAULT_PRESET[cls.command]
    if "/" in name or "\\" in name or not (PRESETS / f"{name}.yaml").is_file():
        raise Refusal(f"preset {name!r}: not a shipped preset ({', '.join(_presets())})")
    return name, file_settings(PRESETS / f"{name}.yaml")


def _presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def _text(value) -> str:
    """A setting as the form shows it and a key=value override writes it (read back as YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return "" if value is None else str(value)


def form(studio, args: dict) -> dict:
    """Every setting of the command: its default and help (the dataclass's), the preset's value,
    and the group it belongs to; the presets and the cards a plan can be made for."""
    from groundtune import plan

    cls = _cls(args)
    name, preset = _preset(cls, args)
    hints = typing.get_type_hints(cls)
    groups = [k for k in cls.__mro__ if dataclasses.is_dataclass(k) and k is not cls]
    fields = []
    for setting, default, help in settings_of(cls):
        group = next((k.__name__.strip("_").lower() for k in groups if setting in k.__dataclass_fields__), cls.command)
        fields.append({"name": setting, "default": _text(default), "value": _text(preset.get(setting, default)),
                       "help": help, "bool": hints[setting] is bool, "group": group})
    cards = json.loads(plan.CARDS_FILE.read_text())["cards"]
    return {"command": cls.command, "preset": name, "presets": _presets(), "fields": fields,
            "cards": [{"key": k, "name": c["name"]} for k, c in cards.items()] + [{"key": "cpu", "name": "CPU"}],
            "card": plan.DEFAULT_CARD}


def _path_setting(studio, name: str, text: str) -> str:
    if not text or text.startswith(NOT_PATHS):
        return text
    return str(studio.paths.inside(text, f"{name}="))


def _model_setting(studio, text: str) -> str:
    """A model that names a file or folder is held to the work folder; a hub id or tiny is a name."""
    looks_like_path = text.startswith(("/", ".", "~")) or (studio.paths.root / text).exists()
    return str(studio.paths.inside(text, "model=")) if looks_like_path else text


def overrides(studio, cls, preset: dict, given: dict) -> list[str]:
    """key=value for each setting the form changed from the preset, and every path setting made
    absolute inside the work folder (the preset's own relative ones too)."""
    known = {name: default for name, default, _ in settings_of(cls)}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise Refusal(f"unknown setting(s) {', '.join(unknown)}; see `groundtune {cls.command} --help`")
    out = []
    for name, default in known.items():
        text = str(given[name]).strip() if name in given else _text(preset.get(name, default))
        made_absolute = False
        if name in PATH_SETTINGS or name == "model":
            confined = _path_setting(studio, name, text) if name != "model" else _model_setting(studio, text)
            made_absolute, text = confined != text, confined
        if made_absolute or text != _text(preset.get(name, default)):
            out.append(f"{name}={text}")
    return out


def _config(studio, args: dict):
    cls = _cls(args)
    name, preset = _preset(cls, args)
    given = args.get("settings") or {}
    if not isinstance(given, dict):
        raise Refusal("settings: expected a mapping of setting names to values")
    extra = overrides(studio, cls, preset, given)
    return cls, PRESETS / f"{name}.yaml", extra, load_config(cls, PRESETS / f"{name}.yaml", extra)


def plan_run(studio, args: dict) -> dict:
    """`groundtune plan`'s verdict on the form's settings for the chosen card."""
    from groundtune import plan

    cls, _, extra, cfg = _config(studio, args)
    if cls is not TrainConfig:
        return {"text": "groundtune plan sizes SFT runs (train); an RL run's rollouts are not planned: start it and "
                        "watch its GPU memory", "fits": None, "overrides": extra}
    result = plan.plan_run(cfg, plan.card(args.get("card") or plan.DEFAULT_CARD))
    return {"text": plan.render(result), "fits": result.plan.fits, "overrides": extra}


def start(studio, args: dict) -> dict:
    """A real `groundtune train|rl PRESET key=value ...` process."""
    cls, preset, extra, cfg = _config(studio, args)
    run = Path(cfg.out_dir)
    if any(j.about.get("run") == studio.paths.shown(run) for j in studio.jobs.running()):
        raise Refusal(f"{studio.paths.shown(run)}: a run the studio started is still running there")
    job = studio.jobs.start(cls.command, [cls.command, str(preset), *extra], run=studio.paths.shown(run))
    return job.to_json()


def run_folder(studio, given: str) -> Path:
    """A run folder the page names: inside the work folder, and a groundtune run."""
    path = studio.paths.inside(given, "run")
    if not path.is_dir() or not is_run(path):
        raise Refusal(f"{studio.paths.shown(path)}: not a groundtune run folder (no {RunFolder(path).config.name} "
                      f"and no {RunFolder(path).checkpoints.name}/); pick one of the runs listed")
    return path


def stop(studio, args: dict) -> dict:
    """The run's STOP file: it saves a checkpoint at the end of its step and exits (resumable)."""
    run = run_folder(studio, args.get("run", ""))
    folder = RunFolder(run)
    started_here = any(j.about.get("run") == studio.paths.shown(run) for j in studio.jobs.running())
    if not started_here and not folder.lock.exists():
        raise Refusal(f"{studio.paths.shown(run)} is not running: nothing to stop")
    folder.stop.touch()
    return {"run": studio.paths.shown(run), "stop": studio.paths.shown(folder.stop)}


def resume(studio, args: dict) -> dict:
    """`groundtune train|rl --resume RUN`: the run goes on from its last checkpoint."""
    run = run_folder(studio, args.get("run", ""))
    if any(j.about.get("run") == studio.paths.shown(run) for j in studio.jobs.running()):
        raise Refusal(f"{studio.paths.shown(run)} is running: stop it first")
    if not RunFolder(run).config.is_file():
        raise Refusal(f"{studio.paths.shown(run)}: no {RunFolder(run).config.name} to resume from")
    command = command_of(run)
    job = studio.jobs.start(command, [command, "--resume", str(run)], run=studio.paths.shown(run))
    return job.to_json()


def saved_settings(run: Path) -> dict:
    """The run's saved config.yaml, read as every settings file is (``config.file_settings``: bounded
    before YAML expands it); {} when it has none or it cannot be read."""
    try:
        return file_settings(RunFolder(run).config)
    except (OSError, ConfigError):
        return {}


def command_of(run: Path) -> str:
    """train or rl: which settings the run's saved config.yaml holds."""
    return command_for(saved_settings(run))


def command_for(saved: dict) -> str:
    """train or rl: which command's settings ``saved`` (a run's config.yaml) holds."""
    rl_only = {f.name for f in dataclasses.fields(RLConfig)} - {f.name for f in dataclasses.fields(TrainConfig)}
    return "rl" if rl_only & set(saved) else "train"
