"""Hugging Face interop: load transformers checkpoints into tfcli models and export them back.

One module per family (gpt2.py, bert.py, t5.py, vit.py), each a pair of pure functions that
rename and reshape state dicts, plus config translation.
"""

from pathlib import Path

# model family -> module of this package that has export(loaded, out) (a loaded tfcli run -> HF directory)
EXPORTERS = {
    "gpt": "gpt2",
    "bert": "bert",
    "t5": "t5",
    "vit": "vit",
}


def export_run(path: Path, out: Path) -> str:
    """Write the run (its best checkpoint, else its latest) as a transformers directory; return the
    architecture written. Dispatches on the run's model family."""
    import importlib

    from ..errors import UserError
    from ..inference import load_run

    loaded = load_run(Path(path), which="best")
    family = loaded.recipe.model.family
    if family not in EXPORTERS:
        raise UserError(f"export to Hugging Face is not available for {family!r} models "
                        f"(available: {', '.join(sorted(EXPORTERS))})")
    return importlib.import_module(f"{__name__}.{EXPORTERS[family]}").export(loaded, Path(out))
