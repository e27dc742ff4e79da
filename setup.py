"""The wheel carries the recipes: `build_py` copies them, the tiny model they start from and the seed's train.py into
hf_zero3/_shipped/, where `hf_zero3.recipes` finds them when no source checkout is there (metadata: setup.cfg)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHIPPED = ("recipes", "assets/tiny/model", "train.py")
"""Relative to the checkout, and to hf_zero3/_shipped/ in the wheel (the recipes' YAMLs name assets/tiny/model)."""


class BuildPyWithRecipes(build_py):
    def run(self):
        super().run()
        here, target = Path(__file__).resolve().parent, Path(self.build_lib) / "hf_zero3" / "_shipped"
        for name in SHIPPED:
            source, dest = here / name, target / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, dest)


setup(cmdclass={"build_py": BuildPyWithRecipes})
