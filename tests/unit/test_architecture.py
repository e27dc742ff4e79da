"""The layers of docs/architecture.md hold, read from the imports themselves.

Every import in every module of hf_zero3 counts: at module level, inside functions, under TYPE_CHECKING, and the
package `__init__` that importing `a.b.c` runs. Each points into its own layer or one below (never up, never
sideways into a peer), and no two modules need each other (no cycle, however long). A new upward edge fails here
with the two modules named; docs/architecture.md says where each fact's owner lives.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "hf_zero3"

LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("hf_zero3.cli", "hf_zero3.__main__", "hf_zero3.train"),),
    (("hf_zero3.ops",),),
    (("hf_zero3.run",),),
    (("hf_zero3.callbacks",),),
    (("hf_zero3.checkpoint",),),
    (("hf_zero3/run/__init__.py", "hf_zero3.run.facts", "hf_zero3.run.distributed"),),
    (("hf_zero3.plan",),),
    (("hf_zero3.config",), ("hf_zero3.data",)),
    (("hf_zero3/__init__.py", "hf_zero3.argtypes", "hf_zero3.recipes"),),
)
"""Top first. A row's parts (config, data) are peers: neither imports the other. A module belongs to the longest
name listed that is it or a package above it; an `__init__.py` listed is that package's own module only (run/'s is
empty and sits in the lowest of its layers: importing run.facts runs it)."""

LAYER_NAMES = ("the face: `hf-zero3 <verb>`, `python -m hf_zero3.train`", "operations beside the flow",
               "one run: train, launch, OOM advice", "callbacks", "checkpoints", "what a run is",
               "the planner", "configs; the user's data (peers)", "base: units, argument types, the recipe registry")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def edges() -> dict[str, dict[str, int]]:
    """module -> {imported module: line}, with every package __init__ on the way."""
    mods = modules()
    out: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package this module is in (or is)
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                    imported = ".".join(parts[:i])
                    if imported in mods and imported != name and not name.startswith(imported + "."):
                        out[name].setdefault(imported, node.lineno)
    return out


def place(module: str) -> tuple[int, int] | None:
    """(row, part) of a module in LAYERS, or None when no row lists it."""
    best = None
    for row, parts in enumerate(LAYERS):
        for part, names in enumerate(parts):
            for listed in names:
                if listed.endswith("/__init__.py"):
                    length = 1000 if module == listed.removesuffix("/__init__.py").replace("/", ".") else -1
                else:
                    length = len(listed) if module == listed or module.startswith(listed + ".") else -1
                if length >= 0 and (best is None or length > best[0]):
                    best = (length, row, part)
    return best and best[1:]


def render_layers() -> str:
    """The layer table of docs/architecture.md, from LAYERS."""
    lines = ["| layer, top first | modules |", "|---|---|"]
    for name, parts in zip(LAYER_NAMES, LAYERS, strict=True):
        lines.append(f"| {name} | " + " \\| ".join(", ".join(f"`{m}`" for m in names) for names in parts) + " |")
    return "\n".join(lines)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if place(m) is None)
    assert not unplaced, f"modules in no layer: {unplaced}: add each to LAYERS and docs/architecture.md"


def test_no_import_points_up_or_sideways():
    wrong = []
    for module, imported in edges().items():
        here = place(module)
        for target, line in imported.items():
            there = place(target)
            if here and there and (there[0] < here[0] or (there[0] == here[0] and there[1] != here[1])):
                way = "up" if there[0] < here[0] else "sideways"
                wrong.append(f"{modules()[module].relative_to(ROOT)}:{line} imports {target} ({way})")
    assert sorted(wrong) == sorted(KNOWN_WRONG), (
        "imports against the layers of docs/architecture.md (move the fact's owner down to where both can ask "
        "it):\n" + "\n".join(sorted(set(wrong) - set(KNOWN_WRONG))))


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph, index, low, stack, on, found = edges(), {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_two_modules_need_each_other():
    assert cycles() == KNOWN_CYCLES


def test_the_doc_shows_these_layers():
    assert render_layers() in DOC.read_text(), "docs/architecture.md's layer table differs from LAYERS:\n" + \
        render_layers()


def test_every_module_and_folder_the_doc_names_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`(hf_zero3/[\w/]+(?:\.py)?)`", text))
    for folder, files in re.findall(r"\| `(hf_zero3/\w+/)` \| ([^|]+) \|", text):
        named |= {folder + name for name in re.findall(r"`(\w+\.py)`", files)}
    named |= {m.replace(".", "/") for m in re.findall(r"`(hf_zero3\.[\w.]+)`", text)}
    assert len(named) >= 25, sorted(named)
    missing = sorted(n for n in named if not any((ROOT / p).exists() for p in (n, n + ".py", n + "/__init__.py")))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_package_folder_is_in_the_doc():
    text = DOC.read_text()
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert set(folders) >= {"callbacks", "checkpoint", "cli", "config", "data", "ops", "plan", "run"}
    assert all(f"`hf_zero3/{name}/`" in text for name in folders), folders


def test_the_memory_model_is_pure_arithmetic():
    """plan.memory imports nothing that reads the machine, at any level (the planner plans for other machines)."""
    tree = ast.parse((PACKAGE / "plan" / "memory.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"torch", "psutil", "os", "shutil", "subprocess"}, imported
    assert not {t for t in edges()["hf_zero3.plan.memory"] if t.startswith("hf_zero3.plan.hardware")}


KNOWN_WRONG: list[str] = [
    "hf_zero3/checkpoint/card.py:99 imports hf_zero3.callbacks (up)",
    "hf_zero3/checkpoint/card.py:99 imports hf_zero3.callbacks.perplexity (up)",
    "hf_zero3/plan/oom.py:33 imports hf_zero3.run (up)",
    "hf_zero3/plan/oom.py:33 imports hf_zero3.run.facts (up)",
    "hf_zero3/plan/report.py:10 imports hf_zero3.checkpoint (up)",
    "hf_zero3/plan/report.py:10 imports hf_zero3.checkpoint.space (up)",
    "hf_zero3/run/facts.py:66 imports hf_zero3.run.train (up)",
    "hf_zero3/run/launch.py:162 imports hf_zero3.ops (up)",
    "hf_zero3/run/launch.py:162 imports hf_zero3.ops.doctor (up)",
    "hf_zero3/run/train.py:684 imports hf_zero3.ops (up)",
    "hf_zero3/run/train.py:684 imports hf_zero3.ops.plots (up)",
]
"""Imports against the layers that are still to move: this list only shrinks (empty once they have)."""
KNOWN_CYCLES: list[list[str]] = [
    ["hf_zero3.callbacks", "hf_zero3.callbacks.hub_push", "hf_zero3.callbacks.throughput", "hf_zero3.checkpoint.card",
     "hf_zero3.checkpoint.export", "hf_zero3.plan.oom", "hf_zero3.run.facts", "hf_zero3.run.train"],
    ["hf_zero3.plan.memory", "hf_zero3.plan.speed"],
]
