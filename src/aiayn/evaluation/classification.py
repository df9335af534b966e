"""Classifier scores from a confusion matrix: accuracy, per-class precision / recall / F1,
macro-F1 (the unweighted mean of the classes' F1, so a rare class counts as much as a common
one), and the matrix as a picture."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ClassificationScores:
    accuracy: float
    macro_f1: float
    precision: list[float]  # per class
    recall: list[float]
    f1: list[float]
    support: list[int]  # true examples per class


def confusion_matrix(labels: Sequence[int], predicted: Sequence[int], n_classes: int) -> np.ndarray:
    """(n_classes, n_classes) counts: row = true class, column = predicted class."""
    true = np.asarray(labels, dtype=np.int64)
    pred = np.asarray(predicted, dtype=np.int64)
    if true.shape != pred.shape:
        raise ValueError(f"{true.size} labels but {pred.size} predictions")
    cells = np.bincount(true * n_classes + pred, minlength=n_classes * n_classes)
    return cells.reshape(n_classes, n_classes)


def classification_scores(matrix: np.ndarray) -> ClassificationScores:
    """Scores of a confusion matrix (row = true class). The macro average takes the classes
    that occur among the true or the predicted labels (as scikit-learn's ``f1_score`` with
    ``average="macro"`` does when it is given the labels alone): a class absent from both,
    e.g. a book with no chapter in the test split, is left out, not counted as F1 0."""
    matrix = np.asarray(matrix, dtype=np.float64)
    hits = np.diag(matrix)
    true = matrix.sum(axis=1)
    predicted = matrix.sum(axis=0)
    total = matrix.sum()
    precision = np.divide(hits, predicted, out=np.zeros_like(hits), where=predicted > 0)
    recall = np.divide(hits, true, out=np.zeros_like(hits), where=true > 0)
    seen = (true > 0) | (predicted > 0)
    both = precision + recall
    f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(hits), where=both > 0)
    return ClassificationScores(
        accuracy=float(hits.sum() / total) if total else 0.0,
        macro_f1=float(f1[seen].mean()) if seen.any() else 0.0,
        precision=precision.tolist(),
        recall=recall.tolist(),
        f1=f1.tolist(),
        support=[int(n) for n in true],
    )


def plot_confusion(matrix: np.ndarray, names: Sequence[str], path: str | Path, title: str) -> Path:
    """Write the confusion matrix as a PNG: rows true, columns predicted, each row shaded by
    its share (recall), counts in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix = np.asarray(matrix)
    rows = matrix.sum(axis=1, keepdims=True)
    share = np.divide(matrix, rows, out=np.zeros(matrix.shape), where=rows > 0)
    size = 1.8 + 0.7 * len(names)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            color = "white" if share[i, j] > 0.6 else "black"
            ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", color=color)
    fig.colorbar(image, ax=ax, label="share of the true class")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
