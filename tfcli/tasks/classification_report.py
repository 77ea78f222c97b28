"""Classification metrics and their tables: accuracy beside the majority class, per-class
precision/recall, confusion matrix. Every classification route reports through here."""

from __future__ import annotations

import numpy as np
from rich.table import Table


def confusion(pred: np.ndarray, gold: np.ndarray, n: int) -> np.ndarray:
    """(n, n) counts: rows are the gold label, columns the prediction."""
    m = np.zeros((n, n), dtype=np.int64)
    np.add.at(m, (gold, pred), 1)
    return m


def metrics(pred: np.ndarray, gold: np.ndarray, labels: tuple[str, ...]) -> dict:
    """Accuracy, the majority-class baseline, and precision and recall of each class (0 where undefined)."""
    m = confusion(pred, gold, len(labels))
    n = int(m.sum())
    out = {
        "acc": float(np.trace(m) / max(1, n)),
        "n": n,
        "majority": float(m.sum(1).max() / max(1, n)),
        "labels": list(labels),
        "confusion": m.tolist(),
    }
    for i, name in enumerate(labels):
        out[f"precision_{name}"] = float(m[i, i] / m[:, i].sum()) if m[:, i].sum() else 0.0
        out[f"recall_{name}"] = float(m[i, i] / m[i].sum()) if m[i].sum() else 0.0
    return out


def headline(split: str, result: dict) -> str:
    """'dev_matched: accuracy 71.85% on 1815 rows (majority class 37.08%)' (k-shot: how many shots fit)."""
    shots = f", {result['shots']:.3g} of {result['k']:g} shots fit in the context on average" if "k" in result else ""
    return (
        f"{split}: accuracy {100 * result['acc']:.2f}% on {result['n']} rows "
        f"(majority class {100 * result['majority']:.2f}%){shots}"
    )


def tables(split: str, result: dict, labels) -> tuple[Table, Table]:
    """A rich table of per-class precision/recall and one of the confusion matrix."""
    per_class = Table("class", "precision", "recall", "gold rows", title=headline(split, result))
    m = np.array(result["confusion"])
    for i, name in enumerate(labels):
        per_class.add_row(
            name,
            f"{100 * result[f'precision_{name}']:.1f}%",
            f"{100 * result[f'recall_{name}']:.1f}%",
            str(int(m[i].sum())),
        )
    matrix = Table("gold \\ predicted", *labels, title=f"{split}: confusion matrix")
    for i, name in enumerate(labels):
        matrix.add_row(name, *(f"[bold]{v}[/]" if j == i else str(v) for j, v in enumerate(m[i])))
    return per_class, matrix
