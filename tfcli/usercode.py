"""The one way tfcli runs the user's own Python: a file.py:name that the command line of that very
command names (`--reward file.py:fn`, `--tools file.py:fn`, `--env file.py:Class`), imported here.
A run, recipe or grid file that records such a name is data: the caller refuses it until the command
line names it too (commands.common.named_code)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .errors import UserError

USER = re.compile(r"(.+\.py):([A-Za-z_]\w*)")


def absolute(body: str) -> str:
    """file.py:name with the file's absolute path (what a run records and what may be imported)."""
    file, name = USER.fullmatch(body).groups()
    return f"{Path(file).expanduser().resolve()}:{name}"


def refuse_unnamed(body: str, named: frozenset[str], flag: str, spec: str) -> None:
    """One line unless this command's own command line names `body` (absolute in `named`)."""
    if absolute(body) not in named:
        raise UserError(
            f"the {flag.lstrip('-')} {absolute(body)} is Python code, which tfcli imports only when this "
            f"command's own command line names it: add {flag} {spec}"
        )


def load(body: str, flag: str, noun: str = "function"):
    """The attribute `name` of the user's file.py (a function or class), imported; a missing file, a
    module that fails to import and a missing name are one line each."""
    file, name = USER.fullmatch(body).groups()
    path = Path(file).expanduser()
    if not path.is_file():
        raise UserError(f"{flag} {body}: no such file {file}")
    spec = importlib.util.spec_from_file_location(f"tfcli_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's module: any error it raises is theirs to see in one line
        raise UserError(f"{flag} {body}: importing {file} failed ({type(e).__name__}: {e})") from None
    value = getattr(module, name, None)
    if value is None:
        raise UserError(f"{flag} {body}: {file} has no {noun} {name}")
    return value
