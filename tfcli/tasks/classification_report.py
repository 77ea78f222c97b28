"""Classification metrics and their tables: accuracy, per-class precision/recall, confusion matrix."""
from __future__ import annotations

import numpy as np


def confusion(pred: np.ndarray, gold: np.ndarray, n: int) -> np.ndarray:
    """(n, n) counts: rows are the gold label, columns the prediction."""
    m = np.zeros((n, n), dtype=np.int64)
    np.add.at(m, (gold, pred), 1)
    return m


def metrics(pred: np.ndarray, gold: np.ndarray, labels: tuple[str, ...]) -> dict:
    """Accuracy, and precision and recall of each class (0 where undefined)."""
    m = confusion(pred, gold, len(labels))
    out = {"acc": float(np.trace(m) / max(1, m.sum())), "n": int(m.sum()), "confusion": m.tolist()}
    for i, name in enumerate(labels):
        out[f"precision_{name}"] = float(m[i, i] / m[:, i].sum()) if m[:, i].sum() else 0.0
        out[f"recall_{name}"] = float(m[i, i] / m[i].sum()) if m[i].sum() else 0.0
    return out


def tables(split: str, result: dict, labels: tuple[str, ...]):
    """A rich table of per-class precision/recall and one of the confusion matrix."""
    from rich.table import Table

    per_class = Table("class", "precision", "recall", "gold rows",
                      title=f"{split}: accuracy {100 * result['acc']:.2f}% on {result['n']} rows")
    m = np.array(result["confusion"])
    for i, name in enumerate(labels):
        per_class.add_row(name, f"{100 * result[f'precision_{name}']:.1f}%",
                          f"{100 * result[f'recall_{name}']:.1f}%", str(int(m[i].sum())))
    matrix = Table("gold \\ predicted", *labels, title=f"{split}: confusion matrix")
    for i, name in enumerate(labels):
        matrix.add_row(name, *(f"[bold]{v}[/]" if j == i else str(v) for j, v in enumerate(m[i])))
    return per_class, matrix
