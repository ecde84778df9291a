"""The house is layered: a module imports only groundtune modules of its own layer or the layers
below (README, "Layout"). data/ knows no model, models/ no training loop; the deploy half sits on
infer.py beside evaluate.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import groundtune

PACKAGE = Path(groundtune.__file__).parent
# lowest first; a module may import its own layer and any layer before it
LAYERS = [
    {"errors", "files", "runs", "progress", "cores", "boxes", "families"},
    {"config"},
    {"data"},
    {"plan"},  # sizes a run from config.json files and settings: no model, no torch
    {"models"},
    {"infer"},
    {"protocols", "evaluate", "deploy"},  # deploy/ (export, serve), beside evaluate on infer
    {"train"},
    {"quickstart", "studio", "cli", "__main__", "__init__"},  # studio/: a web page over the commands
]


def _layer(module: str) -> int:
    top = module.split(".")[1] if module.startswith("groundtune.") else "__init__"
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: in no layer of tests/test_layers.py; add it where it belongs")


def _module(path: Path) -> str:
    """groundtune.data.hub for data/hub.py; a package's __init__.py is the package."""
    return ".".join(("groundtune", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


MODULES = {_module(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """The groundtune modules ``path`` imports, wherever it imports them (inside functions too):
    ``from groundtune.data import hub`` and ``from . import hub`` are groundtune.data.hub."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("groundtune.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .records import ..., from . import sources: relative to the package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            if source == "groundtune" or source.startswith("groundtune."):
                # from PACKAGE import NAME: the module NAME when there is one, else the package
                found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names}
    return found


def test_no_import_runs_back_up():
    wrong = []
    for module, path in MODULES.items():
        for imported in _imports(path):
            if _layer(imported) > _layer(module):
                wrong.append(f"{module} imports {imported}")
    assert not wrong, wrong


def test_the_check_sees_imports_inside_functions():
    # the command line imports its handlers' modules inside the handlers: the check must see them
    assert "groundtune.train.sft" in _imports(PACKAGE / "cli" / "training.py")
    # and a relative import, or a module named after its package, is that module
    assert {"groundtune.data.sources", "groundtune.data.records"} <= _imports(PACKAGE / "data" / "hub.py")
    assert "groundtune.data.hub" in _imports(PACKAGE / "protocols.py")


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (module -> the modules it imports), as a path that ends where
    it starts; [] when there is none."""
    done, path = set(), []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            found = visit(imported)
            if found:
                return found
        path.pop()
        done.add(module)
        return []

    return next((found for found in map(visit, sorted(graph)) if found), [])


def test_no_import_circle():
    """No module imports, at its top or inside a function (a lazy import is an import all the
    same), a module that imports it back, however far round. A package's __init__.py runs before
    its modules: Python's order, not an import of theirs, so that is no edge."""
    circle = _circle({module: _imports(path) for module, path in MODULES.items()})
    assert not circle, "import circle: " + " -> ".join(circle)


def test_the_circle_check_finds_a_lazy_circle():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


# --------------------------------------------------------------------------------------------
# README's Layout block, held to the files and their imports


def _layout_entries() -> list[tuple[str, str]]:
    """The entries of README's Layout block under src/groundtune/, top to bottom: (its first column,
    its whole text). An entry is a line indented two spaces and the deeper-indented lines under it;
    the first line back at the margin (scripts/, bench/, tests/) ends the package."""
    readme = (PACKAGE.parent.parent / "README.md").read_text()
    block = re.search(r"^## Layout\n\n```\nsrc/groundtune/\n(.*?)```", readme, re.S | re.M).group(1)
    entries = []
    for line in block.splitlines():
        if re.match(r"  \S", line):
            entries.append((line[2:].split("  ")[0].strip(), line))
        elif line.startswith("   ") and entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line)
        else:
            break
    return entries


def _layout_places() -> tuple[dict[str, int], list[str]]:
    """Where the Layout puts each source file (its entry's index, top 0), and what it gets wrong.

    The rule: src/groundtune/NAME.py is named where a top-level entry (one not ending in /) writes
    NAME.py; src/groundtune/DIR/NAME.py where the DIR/ entry writes NAME.py. A file named by no entry,
    or by two, is wrong, and so is a NAME.py an entry writes that is no file there. A folder's
    __init__.py takes its folder's entry; groundtune/__init__.py and __main__.py, the package and
    its start, come after every entry."""
    entries = _layout_entries()
    places, wrong = {}, []
    for first, text in entries:
        folder = first if first.endswith("/") else ""
        wrong += [f"src/groundtune/{folder}{name}: named in README.md's Layout, and no such file"
                  for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", text) if not (PACKAGE / folder / name).is_file()]
    for module, path in MODULES.items():
        relative = path.relative_to(PACKAGE)
        if relative.name in ("__init__.py", "__main__.py") and len(relative.parts) == 1:
            places[module] = len(entries)
            continue
        folder = f"{relative.parts[0]}/" if len(relative.parts) > 1 else None
        if relative.name == "__init__.py":
            where = [i for i, (first, _) in enumerate(entries) if first == folder]
        else:
            mention = re.compile(rf"(?<![\w/.]){re.escape(relative.name)}\b")
            where = [i for i, (first, text) in enumerate(entries)
                     if (first == folder if folder else not first.endswith("/")) and mention.search(text)]
        if len(where) != 1:
            how = "no entry" if not where else f"{len(where)} entries ({', '.join(entries[i][0] for i in where)})"
            wrong.append(f"src/groundtune/{relative}: named by {how} of README.md's Layout; name it once, in "
                         f"{'the ' + folder + ' entry' if folder else 'its own entry'}")
            continue
        places[module] = where[0]
    return places, wrong


def test_the_readmes_layout_names_every_source_file():
    _, wrong = _layout_places()
    assert not wrong, "\n".join(wrong)


def test_imports_follow_the_readmes_layout():
    """README's Layout says each module imports only those above it: a module may import those of
    entries above its own, and those of its own entry."""
    places, _ = _layout_places()
    entries = _layout_entries()
    wrong = [f"src/groundtune/{path.relative_to(PACKAGE)} imports {imported}, which README.md's Layout lists below it "
             f"({entries[places[imported]][0]!r} under {entries[places[module]][0]!r})"
             for module, path in MODULES.items() if module in places
             for imported in sorted(_imports(path)) if imported in places and places[imported] > places[module]]
    assert not wrong, "\n".join(wrong)


def test_the_readmes_layout_lists_the_layers_in_order():
    """README's Layout lists the package lowest layer first and says each imports only what is above
    it: its order must be LAYERS' order, and it must name every module the layers hold."""
    named = [name.strip().removesuffix(".py").removesuffix("/")
             for first, _ in _layout_entries() for name in first.split(",") if name.strip().endswith((".py", "/"))]
    named = [n for n in named if n != "configs"]  # presets: YAML, no imports
    ranks = [_layer(f"groundtune.{name}") for name in named]
    assert ranks == sorted(ranks), list(zip(named, ranks))
    layered = {name for layer in LAYERS for name in layer} - {"__main__", "__init__"}
    assert layered <= set(named), layered - set(named)
