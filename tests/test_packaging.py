"""What a wheel built from the tree holds: every package, and the recipes of the checkout's recipes/,
which an installed tfcli lists (`tfcli recipes`) without the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow  # builds a wheel


def test_the_packages_pyproject_names_are_the_trees():
    import tomllib

    named = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "tfcli").rglob("__init__.py")}
    assert named == tree | {"tfcli.recipes"}


def test_a_wheel_holds_the_recipes_and_its_tfcli_lists_them(tmp_path):
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO), "-w"]
    subprocess.run([*build, str(tmp_path / "dist")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("tfcli-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
    assert len(shipped) > 20 and all(f"tfcli/recipes/{n}" in names for n in shipped)
    target = tmp_path / "installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tfcli, sys; print(tfcli.__file__); from tfcli.cli import main; sys.argv=['tfcli', 'recipes']; main()",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith(str(target)), listed.stdout  # the wheel's tfcli, not the checkout's
    assert all(n.removesuffix(".yaml") in listed.stdout for n in shipped[:5])


def test_a_checkout_run_in_place_without_installing_finds_its_recipes():
    """A checkout on PYTHONPATH, never installed (a lent GPU machine has no network to build one): its
    recipes are read from recipes/ beside tfcli/. `-S` with site-packages on PYTHONPATH keeps torch and the
    other dependencies importable but not the editable install's finder that maps tfcli.recipes."""
    import sysconfig

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"]])}
    code = "import tfcli.recipe as r; print(r.RECIPES_DIR); print(r.load('gpt2-small').model.n_layer)"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd="/")
    assert out.returncode == 0, out.stderr[-600:]
    assert out.stdout.split() == [str(REPO / "recipes"), "12"]
