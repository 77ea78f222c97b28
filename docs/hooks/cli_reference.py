"""mkdocs hook: the command-line reference page is generated from the typer app at build time, so it
can never disagree with `tfcli --help`. The page's marker `<!-- cli-reference -->` becomes each
command's help text, in the order `tfcli --help` lists them (a group's subcommands after it)."""

from __future__ import annotations

MARKER = "<!-- cli-reference -->"
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


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, reference()) if MARKER in markdown else markdown
