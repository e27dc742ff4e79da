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

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "hf_zero3"

LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    (("hf_zero3.cli", "hf_zero3.__main__", "hf_zero3.train"),),
    (("hf_zero3.ops",),),
    (("hf_zero3.run",),),
    (("hf_zero3.callbacks",),),
    (("hf_zero3.checkpoint",),),
    (("hf_zero3.model",),),
    (("hf_zero3.job",),),
    (("hf_zero3.plan",),),
    (("hf_zero3.config",), ("hf_zero3.data",)),
    (("hf_zero3/__init__.py", "hf_zero3.units", "hf_zero3.argtypes", "hf_zero3.parsing", "hf_zero3.recipes"),),
)
"""Top first. A row's parts (config, data) are peers: neither imports the other. Each entry is one folder or one
top-level module, listed once, so a folder is one layer and any import from a folder into one above it fails. A module
belongs to the longest name listed that is it or a package above it; an `__init__.py` listed is that package's own
module only."""

LAYER_NAMES = ("the face: `hf-zero3 <verb>`, `python -m hf_zero3.train`", "operations beside the flow",
               "one run: train, launch, OOM advice", "callbacks", "checkpoints",
               "model preparation: adapter, leaf modules, FP8, compile, offload", "what a run is",
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


def test_every_import_names_a_module_that_exists():
    """`from hf_zero3.x import y` where x is gone (moved to its owner) fails here, not at some run's import."""
    mods, missing = modules(), []
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("hf_zero3"):
                if node.module not in mods:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                missing += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                            if a.name.startswith("hf_zero3") and a.name not in mods]
    assert not missing, "\n".join(missing)


def test_each_folder_is_one_layer():
    """No module of a folder is listed apart from its folder, and nothing is listed twice: a folder split across
    layers would let its low modules import up into its own high ones' floor."""
    listed = [name for parts in LAYERS for names in parts for name in names]
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    inner = [n for n in listed if n.replace("/", ".").removesuffix(".py").removesuffix(".__init__").count(".") > 1]
    assert not inner, f"modules listed apart from their folder: {inner}"


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
    assert not wrong, ("imports against the layers of docs/architecture.md (move the fact's owner down to where "
                       "both can ask it):\n" + "\n".join(sorted(wrong)))


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
    assert cycles() == [], "modules that need each other: give the fact they share one owner below both"


def silent_deferred_imports(path: Path) -> list[int]:
    """Lines of the hf_zero3 imports inside functions (or under TYPE_CHECKING) of `path` that give no reason: no
    comment on their lines or the line above, nor a reason on the imports they follow (a run of imports, blank
    lines between groups allowed)."""
    text = path.read_text()
    lines, silent = text.splitlines(), []
    for scope in ast.walk(ast.parse(text)):
        if isinstance(scope, ast.If) and "TYPE_CHECKING" not in ast.unparse(scope.test):
            continue
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):
            continue
        previous, reason = None, False
        for node in scope.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                previous, reason = None, False
                continue
            follows = previous is not None and all(not line.strip() for line in lines[previous:node.lineno - 1])
            reason = any("#" in line for line in lines[node.lineno - 2:node.end_lineno]) or (follows and reason)
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if not reason and (getattr(node, "level", 0) or any(n.split(".")[0] == "hf_zero3" for n in names)):
                silent.append(node.lineno)
            previous = node.end_lineno
    return silent


def test_a_deferred_import_says_why():
    """An hf_zero3 import inside a function is for start-up time only, and says so in a comment. Anything else hides
    an edge the layers forbid, or a cycle they would show."""
    silent = [f"{path.relative_to(ROOT)}:{line}" for path in modules().values() for line in silent_deferred_imports(path)]
    assert not silent, ("imports inside functions without a reason (import at module level, or say in a comment "
                        "which start-up they keep fast):\n" + "\n".join(silent))


def test_the_doc_shows_these_layers():
    assert render_layers() in DOC.read_text(), "docs/architecture.md's layer table differs from LAYERS:\n" + \
        render_layers()


def test_every_module_and_folder_the_doc_names_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`(hf_zero3/[\w/]+(?:\.py)?)`", text))
    for folder, section in re.findall(r"^### `(hf_zero3/\w+/)`\n(.*?)(?=^#|\Z)", text, re.MULTILINE | re.DOTALL):
        items = "\n".join(line for line in section.splitlines() if line.startswith("- "))
        named |= {folder + name for name in re.findall(r"`(\w+\.py)`", items)}
    named |= {m.replace(".", "/") for m in re.findall(r"`(hf_zero3\.[\w.]+)`", text)}
    assert len(named) >= 25, sorted(named)
    missing = sorted(n for n in named if not any((ROOT / p).exists() for p in (n, n + ".py", n + "/__init__.py")))
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_package_folder_is_in_the_doc():
    text = DOC.read_text()
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert set(folders) >= {"callbacks", "checkpoint", "cli", "config", "data", "job", "model", "ops", "plan", "run"}
    assert all(f"`hf_zero3/{name}/`" in text for name in folders), folders


@pytest.mark.parametrize("name", ["types", "memory", "partitions", "choose", "advice"])
def test_the_memory_model_is_pure_arithmetic(name):
    """The planner's arithmetic imports nothing that reads the machine, at any level (it plans for other machines)."""
    tree = ast.parse((PACKAGE / "plan" / f"{name}.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"torch", "psutil", "os", "shutil", "subprocess"}, imported
    assert not {t for t in edges()[f"hf_zero3.plan.{name}"] if t.startswith("hf_zero3.plan.hardware")}


MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 500


def lengths() -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every function (`path:name`, nested ones too) and of every module of hf_zero3."""
    functions, files = {}, {}
    for path in modules().values():
        text, name = path.read_text(), path.relative_to(ROOT).as_posix()
        files[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{name}:{node.name}"
                functions[key] = max(functions.get(key, 0), node.end_lineno - node.lineno + 1)
    return functions, files


def test_functions_and_modules_stay_short():
    """A function over 60 lines is split into named steps, a module over 500 by its jobs (ENGINEERING.md), when the
    step that makes it too long lands."""
    functions, files = lengths()
    long = [f"{k}: {n} lines" for k, n in sorted(functions.items())
            if n > MAX_FUNCTION_LINES]
    long += [f"{k}: {n} lines" for k, n in sorted(files.items())
             if n > MAX_MODULE_LINES]
    assert not long, (f"over {MAX_FUNCTION_LINES} lines a function, {MAX_MODULE_LINES} a module: split it into "
                      "named steps (or by job):\n" + "\n".join(long))
