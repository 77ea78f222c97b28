"""The tools tfcli ships, which run no code a model writes: `calculator` parses arithmetic into a
tree of numbers and operators and computes it (nothing is evaluated as Python), and `lookup` finds a
key in a JSONL table the user names (`--tools lookup:facts.jsonl`)."""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000  # a result longer than this is refused (2**10**9 would take the run's memory)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic to compute, for example "(12 + 30) * 4.5".
    """
    text = str(expression).replace("×", "*").replace("÷", "/").replace("^", "**").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not arithmetic: {str(expression)[:80]!r}") from None
    value = _compute(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _compute(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_compute(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _compute(node.left), _compute(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(1.0, _digits(left)) > 4 * MAX_DIGITS:
            raise ValueError("the power is too large")
        if isinstance(node.op, ast.Mult) and _digits(left) + _digits(right) > MAX_DIGITS:
            raise ValueError("the product is too large")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"not arithmetic: {ast.unparse(node)[:60]!r} (numbers and + - * / // % ** only)")


def _digits(x) -> float:
    return len(str(int(abs(x)))) if isinstance(x, int) else 1.0


def lookup_tool(path: str) -> Callable[[str], str]:
    """The `lookup` tool over the JSONL table at `path`: each row an object, its "key" field (else its
    first field) what the model asks for; the answer is the row's "value" (else the rest of the row as
    JSON). Keys match without regard to case or runs of spaces. A missing or unreadable table is one line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"--tools lookup:{path}: no such file")
    table: dict[str, str] = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"--tools lookup:{path}: line {n} is not JSON") from None
        if not isinstance(row, dict) or not row:
            raise UserError(f"--tools lookup:{path}: line {n} is not an object with a key")
        key_field = "key" if "key" in row else next(iter(row))
        rest = {k: v for k, v in row.items() if k != key_field}
        value = rest["value"] if set(rest) == {"value"} else rest
        table[_normal(row[key_field])] = value if isinstance(value, str) else json.dumps(value)
    if not table:
        raise UserError(f"--tools lookup:{path}: the table has no rows")

    def lookup(key: str) -> str:
        """Look a key up in the table and return what it holds.

        Args:
            key: What to look up.
        """
        found = table.get(_normal(key))
        if found is None:
            raise LookupError(f"no entry for {str(key)[:80]!r}")
        return found

    return lookup


def _normal(key) -> str:
    return " ".join(str(key).split()).casefold()
