"""A tokenizer's special tokens and chat template, as Hugging Face directories record them.

`tokenizer_config.json` (and the older `special_tokens_map.json`) name bos/eos/pad/unk/mask (a
string, or an AddedToken dict with its `content`) and may carry a Jinja `chat_template`. tfcli
reads them from a model directory, keeps them beside a run's tokenizer.json, and writes them back
on export, so a model answers in the format it was trained on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import UserError

CONFIG_FILE = "tokenizer_config.json"
MAP_FILE = "special_tokens_map.json"


@dataclass(frozen=True)
class SpecialTokens:
    """The text of each special token a tokenizer defines (None: it has none)."""

    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    unk: str | None = None
    mask: str | None = None

    def to_config(self) -> dict[str, str]:
        """tokenizer_config.json's keys: bos_token, eos_token, ..."""
        return {f"{k}_token": v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_config(cls, raw: dict) -> SpecialTokens:
        def text(value) -> str | None:
            return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

        return cls(**{f.name: text(raw.get(f"{f.name}_token")) for f in fields(cls)})


def read_config(directory: Path) -> tuple[SpecialTokens, str | None]:
    """(special tokens, chat template) of a Hugging Face or tfcli directory; empty when it has none."""
    raw: dict = {}
    for name in (MAP_FILE, CONFIG_FILE):  # tokenizer_config.json wins
        path = Path(directory) / name
        if path.is_file():
            try:
                raw.update(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                raise UserError(f"{path}: not readable JSON ({e.__class__.__name__})") from None
    template = template_of(raw)
    chat = Path(directory) / "chat_template.jinja"  # newer transformers write it beside the config
    if template is None and chat.is_file():
        template = chat.read_text()
    return SpecialTokens.from_config(raw), template


def template_of(raw: dict) -> str | None:
    """A tokenizer_config's `chat_template`: a string, or the one named `default` of several."""
    template = raw.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def config_text(specials: SpecialTokens, chat_template: str | None, base: dict | None = None) -> str:
    """tokenizer_config.json holding `base` (a family's own keys), the special tokens and the template."""
    out = {**(base or {}), **specials.to_config()}
    if chat_template:
        out["chat_template"] = chat_template
    return json.dumps(out, indent=2)
