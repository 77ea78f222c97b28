"""Hugging Face hub ids for --from and --checkpoint: `google-t5/t5-small` is read from the local
Hugging Face cache (HF_HOME / HF_HUB_CACHE) when it is there, downloaded when the hub is reachable,
and otherwise refused in one line saying what was looked for and where. Only weights, configs and
tokenizer files are fetched (never code: tfcli runs none of it).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UserError

# what a model directory needs; pytorch_model.bin only when a repository has no safetensors
FILES = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "special_tokens_map.json",
    "preprocessor_config.json",
    "processor_config.json",
    "modules.json",
    "1_Pooling/config.json",
]
LEGACY = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"]


def snapshot(source: str, flag: str = "--from") -> Path:
    """A hub id (engine.model_source decides that it is one) -> its snapshot directory: the cache
    first, then the hub."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise UserError(
            f"{flag} {source}: reading a hub id needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        return Path(snapshot_download(source, allow_patterns=FILES, local_files_only=True))
    except Exception:
        pass  # not (fully) in the cache: try the hub
    offline = (
        f"; on a machine that reaches the hub, `hf download {source} --local-dir DIR` (or the same with "
        f"HF_HOME set to the cache you copy over) fetches it, then give {flag} DIR"
    )
    if constants.HF_HUB_OFFLINE:
        raise UserError(
            f"{flag} {source}: not a local path, and not in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (HF_HUB_OFFLINE is set){offline}"
        )
    try:
        path = Path(snapshot_download(source, allow_patterns=FILES, etag_timeout=10))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(source, allow_patterns=FILES + LEGACY, etag_timeout=10))
        return path
    except Exception as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else e.__class__.__name__
        raise UserError(
            f"{flag} {source}: not a local path, not in the Hugging Face cache {constants.HF_HUB_CACHE}, "
            f"and the hub did not give it ({reason}){offline}"
        ) from None
