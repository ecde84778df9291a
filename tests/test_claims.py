"""Every figure the front page stands on is in the file it links to.

README.md: each bold figure (a ``**...**`` holding a digit) must sit in a table row or paragraph
that links a JSON under bench/results, and each of its numbers must be a value of that JSON as
printed (rounded to the decimals shown; a share may be printed as a percentage; "24x" may also be
the ratio of two figures beside it). BENCHMARKS.md's "Current figures" table: the same for each
row's figure, and the row's date and commit are those its JSON was stamped with. Every JSON under
bench/results outside history/ carries its command, commit, date and device.

A figure that drifts from its file, or a file re-made without the figure being updated, fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
JSON_LINK = re.compile(r"(bench/results/[\w./-]+\.json)")
BOLD = re.compile(r"\*\*([^*]*\d[^*]*)\*\*")
NUMBER = re.compile(r"(?<![\w.])[-+]?(\d[\d,]*(?:\.\d+)?)(x?)(?![\w.]*\d)")


def _numbers(data) -> list[float]:
    """Every number in a JSON document (booleans excluded)."""
    if isinstance(data, bool):
        return []
    if isinstance(data, (int, float)):
        return [float(data)]
    if isinstance(data, dict):
        return [n for value in data.values() for n in _numbers(value)]
    if isinstance(data, list):
        return [n for value in data for n in _numbers(value)]
    return []


def _printed(text: str) -> list[tuple[float, int, bool]]:
    """The numbers of a figure as printed: (value, decimals shown, is a ratio "Nx")."""
    found = []
    for digits, ratio in NUMBER.findall(text):
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        found.append((float(digits.replace(",", "")), decimals, ratio == "x"))
    return found


def _shows(value: float, decimals: int, candidates: list[float], percent: bool = True) -> bool:
    """Whether ``value`` printed with ``decimals`` decimals is one of ``candidates`` rounded so
    (or, with ``percent``, a share of them as a percentage)."""
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    scales = (1, 100) if percent else (1,)
    return any(abs(abs(c) * scale - value) <= tolerance for c in candidates for scale in scales)


def _contexts(text: str) -> list[str]:
    """Table rows one by one, other text paragraph by paragraph."""
    out, paragraph = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            out.append(line)
        elif line.strip():
            paragraph.append(line)
            continue
        if paragraph:
            out.append(" ".join(paragraph))
            paragraph = []
    if paragraph:
        out.append(" ".join(paragraph))
    return out


def _check_figures(context: str, where: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the bold figures of one row or paragraph (nothing: [])."""
    figures = BOLD.findall(context)
    if not figures:
        return []
    links = sorted(set(JSON_LINK.findall(context)))
    if not links:
        return [f"{where}: bold figure(s) {figures} link no JSON under bench/results"]
    missing = [link for link in links if not (root / link).is_file()]
    if missing:
        return [f"{where}: {missing} not there"]
    values = [n for link in links for n in _numbers(json.loads((root / link).read_text()))]
    beside = [value for figure in figures for value, _, ratio in _printed(figure) if not ratio]
    wrong = []
    for figure in figures:
        for value, decimals, ratio in _printed(figure):
            ratios = [a / b for a in beside for b in beside if b] if ratio else []
            if not _shows(value, decimals, values + ratios, percent=not ratio):
                wrong.append(f"{where}: **{figure}**: {value:g} is in none of {links}")
    return wrong


def test_every_bold_figure_of_the_readme_is_in_the_json_it_links():
    readme = (ROOT / "README.md").read_text()
    contexts = [c for c in _contexts(readme) if BOLD.search(c)]
    assert contexts, "README.md quotes no bold figure"
    wrong = [problem for i, c in enumerate(contexts) for problem in _check_figures(c, f"README.md, figure {i + 1}")]
    assert not wrong, "\n".join(wrong)


def _current_figures() -> list[dict]:
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in row.strip("|").split("|")))) for row in rows[2:]]


def test_the_current_figures_table_matches_its_files():
    rows = _current_figures()
    assert len(rows) >= 8
    wrong = []
    for row in rows:
        where = f"BENCHMARKS.md current figures, {row['measure']!r}"
        wrong += _check_figures(f"{row['figure']} {row['JSON']}", where)
        # a row whose figure joins two runs (a peer's and ours) links both, their commands in one cell
        links = JSON_LINK.findall(row["JSON"])
        commands = [c.strip("` ") for c in row["command"].split("`; `")]
        assert len(links) == len(commands), f"{where}: one command per linked JSON"
        for link, command in zip(links, commands):
            stamp = json.loads((ROOT / link).read_text())["provenance"]
            if not stamp["date"].startswith(row["date"]) or not stamp["commit"].startswith(row["commit"].strip("`")):
                wrong.append(f"{where}: date {row['date']} / commit {row['commit']} are not {link}'s "
                             f"({stamp['date']}, {stamp['commit'][:7]})")
            if stamp["command"] != command:
                wrong.append(f"{where}: the command is not {link}'s: {stamp['command']}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in RESULTS.glob("*.json")))
def test_every_current_result_says_where_it_came_from(path):
    stamp = json.loads((ROOT / path).read_text()).get("provenance")
    assert stamp, f"{path}: no provenance (bench/provenance.py stamps it); a file that cannot be re-made goes to history/"
    for key in ("command", "commit", "date", "device"):
        assert stamp.get(key) and stamp[key] != "unknown", f"{path}: provenance without {key}"


def test_the_claims_check_can_fail(tmp_path):
    """The checker itself: a figure that is in its file passes, one that drifted does not."""
    (tmp_path / "bench" / "results").mkdir(parents=True)
    link = "bench/results/speed.json"
    (tmp_path / link).write_text(json.dumps({"provenance": {}, "results": [
        {"variant": "plain", "samples_per_s": 1.685}, {"variant": "preset", "samples_per_s": 40.355, "peak_gib": 18.14,
                                                       "share": 0.255}]}))
    assert _printed("0.255 → 0.655") == [(0.255, 3, False), (0.655, 3, False)]
    assert _printed("23.9x the loop, 74,369 phrases, +647 MB, H200") == [(23.9, 1, True), (74369.0, 0, False),
                                                                         (647.0, 0, False)]

    def problems(row: str) -> list[str]:
        return _check_figures(row, "t", root=tmp_path)

    assert not problems(f"| speed | **40.4 samples/s** at **18.1 GiB** | [x]({link}) |")
    assert not problems(f"| share | **25.5%** | [x]({link}) |")  # a share, printed as a percentage
    assert not problems(f"| speed | **40.4** against **1.69**: **23.9x** | [x]({link}) |")  # a ratio of the two
    assert problems(f"| speed | **40.7 samples/s** | [x]({link}) |")  # drifted
    assert problems(f"| speed | **40.4** against **1.69**: **25x** | [x]({link}) |")  # a ratio of nothing beside it
    assert problems("| speed | **40.4 samples/s** | no link |")
    assert problems(f"| speed | **40.4 samples/s** | [x](bench/results/gone.json) |")
