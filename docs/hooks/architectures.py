"""The table of natively read architectures, generated from tfcli's registry (tfcli/hf/registry.py)
between the markers `<!-- architectures -->` and `<!-- /architectures -->` of the README and
docs/interop.md. Both are committed (tests/test_records.py fails when they disagree with the registry:
`python docs/hooks/architectures.py` writes them again), and the mkdocs hook regenerates the page."""

from __future__ import annotations

from pathlib import Path

MARKER, END = "<!-- architectures -->", "<!-- /architectures -->"
ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", ROOT / "docs" / "interop.md")


def with_table(markdown: str) -> str:
    """The page with the registry's table between its markers (what was there before replaced)."""
    from tfcli.hf.registry import architectures_markdown

    head, rest = markdown.split(MARKER, 1)
    return f"{head}{MARKER}\n{architectures_markdown()}{END}{rest.split(END, 1)[1]}"


def on_page_markdown(markdown: str, **_) -> str:  # mkdocs hook
    return with_table(markdown) if MARKER in markdown else markdown


if __name__ == "__main__":
    for page in PAGES:
        page.write_text(with_table(page.read_text()))
