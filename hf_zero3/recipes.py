"""The recipe registry: every `recipes/<name>/` folder, discovered from the filesystem, and what each one says.

Why one owner: the recipe folder, its model, its version and its target hardware were resolved in five places
(the launcher, the planner's `--model`, bench, the checkpoint provenance, the tests), against two roots, one of
them the current directory. Everyone asks here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
CHECKOUT: Path | None = PACKAGE.parent if (PACKAGE.parent / "setup.cfg").is_file() and (
    PACKAGE.parent / "recipes").is_dir() else None
"""The source checkout hf_zero3 runs from (an editable install, PYTHONPATH), or None for an installed wheel."""
SHIPPED = PACKAGE / "_shipped"
"""What a wheel carries instead (setup.py copies it in): recipes/, the tiny model under assets/, train.py."""
ROOT = CHECKOUT or SHIPPED
"""The root the recipes live under: recipes/, and the paths inside their YAMLs (assets/tiny/model) relative to it.
The one answer to "where is the repository": the launcher's train.py, the doctor's code hash and the planner's
shapes ask it."""
RECIPES_DIR = ROOT / "recipes"
FILES = ("ds_config.json", "train_args.yaml", "launch.sh", "README.md")
"""A recipe folder holds exactly these."""


class RecipeError(ValueError):
    """An unknown recipe, or a recipe folder that is missing a part; the message names the fix."""


@dataclass(frozen=True)
class Recipe:
    """One recipe folder (`recipes/<name>/`, or a copy of one anywhere)."""

    folder: Path

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def yaml(self) -> Path:
        return self.folder / "train_args.yaml"

    @property
    def ds_config(self) -> Path:
        return self.folder / "ds_config.json"

    @property
    def launch(self) -> Path:
        return self.folder / "launch.sh"

    @cached_property
    def values(self) -> dict[str, Any]:
        """The YAML's arguments as written (no coercion: `hf_zero3.run.train.load_arguments` owns that)."""
        import yaml

        loaded = yaml.safe_load(self.yaml.read_text()) or {}
        if not isinstance(loaded, dict):
            raise RecipeError(f"{self.yaml} must be a YAML mapping of argument: value")
        return loaded

    @property
    def version(self) -> str | None:
        """`vN` from the YAML's first line, `# Recipe 8b (v2): ...` (recipes/CHANGELOG.md lists the changes)."""
        first = (self.yaml.read_text().splitlines() or [""])[0]
        match = re.search(r"\(v(\d+)\)", first)
        return f"v{match.group(1)}" if match else None

    @property
    def model(self) -> str | None:
        """The model source: pretrained weights first, else the config to start from; a path inside the
        repository is made absolute (the YAML's paths are relative to the repository root)."""
        return resolve_path(self.values.get("model_name_or_path") or self.values.get("config_name"))

    @property
    def from_config(self) -> bool:
        """Random weights from a config (benchmarks, the tiny recipe) rather than pretrained weights."""
        return not self.values.get("model_name_or_path") and bool(self.values.get("config_name"))

    @property
    def config_overrides(self) -> str | None:
        return self.values.get("config_overrides")

    @property
    def target(self) -> str | None:
        """The hardware the recipe is sized for, `NODESxGPUS[xMEM]`, as its launch.sh passes `--target`."""
        if not self.launch.is_file():
            return None
        match = re.search(r"--target\s+(\S+)", self.launch.read_text())
        return match.group(1) if match else None

    def missing(self) -> list[str]:
        return [name for name in FILES if not (self.folder / name).is_file()]


def resolve_path(source: str | None) -> str | None:
    """A path as the recipes' YAMLs write it (relative to ROOT, e.g. assets/tiny/model) made absolute; anything
    else (a hub id, an absolute path, a path that is not under ROOT) as it is."""
    if source and not os.path.isabs(source) and (ROOT / source).exists():
        return str(ROOT / source)
    return source


def all_recipes() -> list[Recipe]:
    """Every recipe shipped in recipes/, by name."""
    return [Recipe(p.parent) for p in sorted(RECIPES_DIR.glob("*/train_args.yaml"))]


def names() -> list[str]:
    return [r.name for r in all_recipes()]


def find(name_or_folder: str | os.PathLike) -> Recipe | None:
    """A shipped recipe by name, or any folder holding train_args.yaml (a user's copy); None otherwise."""
    text = str(name_or_folder)
    if "/" not in text and (RECIPES_DIR / text / "train_args.yaml").is_file():
        return Recipe(RECIPES_DIR / text)
    folder = Path(text).expanduser()
    if (folder / "train_args.yaml").is_file():
        return Recipe(folder.resolve())
    return None


def get(name_or_folder: str | os.PathLike) -> Recipe:
    """Like `find`, but an unknown recipe or a folder missing a part is an error naming the recipes there are."""
    recipe = find(name_or_folder)
    if recipe is None:
        raise RecipeError(f"{name_or_folder} is not a recipe folder: use one of {', '.join(names())} or a folder holding "
                          f"{', '.join(FILES)}")
    if missing := [m for m in recipe.missing() if m in ("train_args.yaml", "ds_config.json")]:
        raise RecipeError(f"{recipe.folder} is not a complete recipe folder: {', '.join(missing)} missing (copy a "
                          "folder from recipes/ and edit it)")
    return recipe


def of_ds_config(path: str | os.PathLike | None) -> Recipe | None:
    """The recipe a run's ds_config belongs to (its folder holds train_args.yaml too), for provenance."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    folder = Path(path).parent
    return Recipe(folder) if (folder / "train_args.yaml").is_file() else None
