"""The command-line reference page, generated from the typer app: each command's help text, in the
order `tfcli --help` lists them (a group's subcommands after it), between the page's markers
`<!-- cli-reference -->` and `<!-- /cli-reference -->`. The page is committed with it, so that it reads
on GitHub too (tests/test_docs.py fails when it disagrees with the app: `python docs/hooks/cli_reference.py`
writes it again), and the mkdocs hook regenerates it when the site is built."""

from __future__ import annotations

from pathlib import Path

MARKER, END = "<!-- cli-reference -->", "<!-- /cli-reference -->"
PAGE = Path(__file__).resolve().parents[1] / "reference" / "cli.md"
WIDTH = 100


def _context(command, name: str, parent=None):
    return command.context_class(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)


def _help(command, path: list[str], parent) -> str:
    ctx = _context(command, path[-1], parent)
    text = f"## `{' '.join(path)}`\n\n```text\n{command.get_help(ctx)}\n```\n"
    if hasattr(command, "list_commands"):  # a group: its subcommands follow
        for name in command.list_commands(ctx):
            text += "\n" + _help(command.get_command(ctx, name), [*path, name], ctx)
    return text


def reference() -> str:
    import typer

    from tfcli.cli import app

    root = typer.main.get_command(app)
    ctx = _context(root, "tfcli")
    return "\n".join(_help(root.get_command(ctx, name), ["tfcli", name], ctx) for name in root.list_commands(ctx))


def with_reference(markdown: str) -> str:
    """The page with the generated reference between its markers (what was there before replaced)."""
    if MARKER not in markdown:
        return markdown
    head, _, rest = markdown.partition(MARKER)
    tail = rest.partition(END)[2] if END in rest else rest
    return f"{head}{MARKER}\n\n{reference()}\n{END}{tail}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    return with_reference(markdown)


if __name__ == "__main__":
    PAGE.write_text(with_reference(PAGE.read_text()))
