"""The documentation site builds without a warning (mkdocs --strict: no broken link, no page left out
of the navigation), its command-line reference is generated from the app and covers every command,
and the README stays a front door."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytest.importorskip("mkdocs")
pytest.importorskip("material")


def test_the_site_builds_strictly_with_every_command_in_its_reference(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    import typer

    from tfcli.cli import app

    root = typer.main.get_command(app)
    for name in root.commands:
        assert f"Usage: tfcli {name} " in page, name
    assert "Usage: tfcli recipes show " in page


def test_the_committed_command_line_reference_is_the_apps(monkeypatch):
    """docs/reference/cli.md read empty on GitHub (the reference was written only when the site was
    built): it is committed, and it is what the app prints now (`python docs/hooks/cli_reference.py`
    writes it again)."""
    monkeypatch.syspath_prepend(str(REPO / "docs" / "hooks"))
    import cli_reference

    page = cli_reference.PAGE.read_text()
    assert "## `tfcli finetune`" in page and "## `tfcli models`" in page
    assert cli_reference.with_reference(page) == page, "run: python docs/hooks/cli_reference.py"


def test_the_readme_is_a_short_front_door_that_links_to_existing_pages():
    import re

    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]+)", text)
    assert len(links) > 10
    assert [link for link in links if not (REPO / link).is_file()] == []


def test_every_documented_error_is_what_tfcli_prints(tmp_path, monkeypatch):
    """`$ tfcli ...` followed by `error: ...` in the README and the docs: the command, run in an empty
    directory, prints that line exactly (the allowed keys of an unknown field went out of date once)."""
    import re
    import shlex

    from .conftest import invoke

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    pairs = [
        (command, error)
        for page in pages
        for command, error in re.findall(r"^\$ tfcli (.+)\n(error: .+)$", page.read_text(), re.M)
    ]
    assert len(pairs) >= 3, pairs
    monkeypatch.chdir(tmp_path)
    for command, error in pairs:
        result = invoke(*shlex.split(command))
        assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == error, (command, result.output)
