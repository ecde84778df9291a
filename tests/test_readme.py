"""The README's commands, run as a newcomer would (with smaller sizes so the suite stays quick)."""

import json
import re
import shlex
from pathlib import Path

import pytest

from groundtune.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _commands() -> list[str]:
    """Every `groundtune ...` command in the README's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        line = line.split("  #")[0].strip()
        if line.startswith("groundtune "):
            commands.append(line)
    return commands


def _run(command: str, **replacements) -> int:
    for old, new in replacements.items():
        command = command.replace(old, new)
    return main(shlex.split(command)[1:])


def test_install_and_test_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^(pip install .*?)\s+# install$", README, re.M).group(1)
    test = re.search(r"^(python -m pytest)\s+# the tests", README, re.M).group(1)
    assert install in ci and test in ci


def test_data_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = _commands()
    synth = [c for c in commands if c.startswith("groundtune data synth")]
    show = [c for c in commands if c.startswith("groundtune data show")]
    assert len(synth) == 2 and len(show) == 1
    for command in synth:
        assert _run(command, **{"--n 10000": "--n 24", "--n 500": "--n 8"}) == 0
    assert len(Path("synth/train.jsonl").read_text().splitlines()) == 24
    assert len(Path("synth/val.jsonl").read_text().splitlines()) == 8
    assert _run(show[0]) == 0 and Path("grid.png").stat().st_size > 0
    # the picture's caption commands, too
    caption = re.search(r"\*`(groundtune data synth[^`]*)` then `(groundtune data show[^`]*)`", README.replace("\n", " "))
    assert caption
    assert _run(caption.group(1), **{"--out synth": "--out caption"}) == 0
    assert _run(caption.group(2), **{"synth/train.jsonl": "caption/train.jsonl"}) == 0
    assert main(["data", "check", "synth/train.jsonl"]) == 0


@pytest.mark.slow
def test_quickstart_command_runs(tmp_path, monkeypatch, capsys):
    """The main-job command, shortened: same code path, a few steps."""
    monkeypatch.chdir(tmp_path)
    assert "groundtune quickstart" in _commands()
    code = main(["quickstart", "--n-train", "64", "--n-eval", "8", "max_steps=4", "eval_every=2",
                 "save_every=2", "log_every=1", "num_workers=0"])
    assert code == 0
    out = capsys.readouterr().out
    assert "Acc@.5" in out and "gallery:" in out and "before ->" in out
    report = json.loads(Path("quickstart/report.json").read_text())
    before, after = report["before"], report["after"]
    assert before["model"] == "tiny" and after["model"] == "quickstart/run"
    assert before["n"] == after["n"] == 8 and {"acc@0.5", "acc@0.75", "miou", "parse_fail_rate"} <= set(after)
    assert report["gain"] == pytest.approx(after["acc@0.5"] - before["acc@0.5"])
    # the variant: canvases the tiny model was not trained on
    record = json.loads(Path("quickstart/data/val.jsonl").read_text().splitlines()[0])
    assert (record["width"], record["height"]) == (168, 168)
    assert Path("quickstart/gallery/index.html").exists()
    assert (Path("quickstart/run/model") / "groundtune.json").exists()
    # running it again resumes nothing (finished) and only re-evaluates
    assert main(["quickstart", "--n-train", "64", "--n-eval", "8"]) == 0
    # the README's RL command goes on from the quickstart's run
    rl = next(c for c in _commands() if c.startswith("groundtune rl quickstart-rl"))
    assert _run(rl + " max_steps=2 batch_size=2 group_size=2 eval_samples=4 eval_every=0 save_every=0") == 0
    assert (Path("quickstart/rl/model") / "adapter_config.json").exists()
    # the README's export command writes what its listing shows, and the export loads back
    export = next(c for c in _commands() if c.startswith("groundtune export quickstart/run"))
    assert _run(export) == 0
    listed = re.search(r"quickstart/export/\n(.*?)```", README, re.S).group(1)
    for name in re.findall(r"^  (\S+?)[ ,]", listed, re.M) + ["chat_template.jinja"]:
        assert (Path("quickstart/export") / name).exists(), name
    image = next(Path("quickstart/data/images").glob("*.png"))
    assert main(["predict", "--model", "quickstart/export", "--image", str(image), "--phrase", "the red circle"]) == 0


def test_presets_named_in_the_readme_exist():
    from groundtune.config import preset_path

    for name in re.findall(r"`([a-z0-9.\-]+)` \((?:tiny|the tiny)", README) + ["qwen2.5-vl-3b-lora-24gb"]:
        assert preset_path(name).exists()
    for command in _commands():
        if command.startswith(("groundtune train ", "groundtune rl ")) and "--" not in command.split()[2]:
            preset = command.split()[2]
            if not preset.endswith(".yaml"):
                assert preset_path(preset).exists(), preset
