"""The house is layered: a module imports only groundtune modules of its own layer or the layers
below (README, "Layout"). data/ knows no model, models/ no training loop; the deploy half sits on
infer.py beside evaluate.py."""

from __future__ import annotations

import ast
from pathlib import Path

import groundtune

PACKAGE = Path(groundtune.__file__).parent
# lowest first; a module may import its own layer and any layer before it
LAYERS = [
    {"errors", "files", "runs", "progress", "boxes", "families"},
    {"config"},
    {"data"},
    {"plan"},  # sizes a run from config.json files and settings: no model, no torch
    {"models"},
    {"infer"},
    {"protocols", "evaluate", "export", "serve", "batching", "onnx_export", "onnx_predict"},  # deploy half, beside evaluate on infer
    {"train"},
    {"quickstart", "cli", "__main__", "__init__"},
]


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.startswith("groundtune.") else module
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: in no layer of tests/test_layers.py; add it where it belongs")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("groundtune.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # from .records import ...: inside the module's own package
                continue
            if node.module == "groundtune":
                found |= {f"groundtune.{a.name}" for a in node.names}
            elif node.module.startswith("groundtune."):
                found.add(node.module)
    return found


def test_no_import_runs_back_up():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = "groundtune." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for imported in _imports(path):
            if _layer(imported) > _layer(module):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_the_check_sees_imports_inside_functions():
    # cli.py imports its handlers' modules inside the handlers: the check must see them
    assert "groundtune.train.sft" in _imports(PACKAGE / "cli.py")


def test_the_readmes_layout_lists_the_layers_in_order():
    """README's Layout lists the package lowest layer first and says each imports only what is above
    it: its order must be LAYERS' order, and it must name every module the layers hold."""
    import re

    readme = (PACKAGE.parent.parent / "README.md").read_text()
    listing = re.search(r"^## Layout\n\n```\nsrc/groundtune/\n(.*?)```", readme, re.S | re.M).group(1)
    named = [name.strip().removesuffix(".py").removesuffix("/")
             for line in listing.splitlines() if re.match(r"  \S", line)
             for name in line.split("  ")[1].split(",") if name.strip().endswith((".py", "/"))]
    named = [n for n in named if n != "configs"]  # presets: YAML, no imports
    ranks = [_layer(f"groundtune.{name}") for name in named]
    assert ranks == sorted(ranks), list(zip(named, ranks))
    layered = {name for layer in LAYERS for name in layer} - {"__main__", "__init__", "onnx_predict"}
    assert layered <= set(named), layered - set(named)
