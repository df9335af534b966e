"""Classifier scores against scikit-learn's definitions, computed by hand here."""

import numpy as np
import pytest

from aiayn.evaluation.classification import (
    classification_scores,
    confusion_matrix,
    plot_confusion,
)


def test_scores_of_a_small_confusion_matrix():
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    predicted = [0, 1, 0, 1, 1, 2, 0, 2, 1]
    matrix = confusion_matrix(labels, predicted, 4)  # class 3 never occurs
    assert matrix.tolist()[0] == [2, 1, 0, 0] and matrix.sum() == 9
    scores = classification_scores(matrix)
    assert scores.accuracy == pytest.approx(6 / 9)
    # class 0: P 2/3, R 2/3; class 1: P 2/4, R 2/2; class 2: P 2/2, R 2/4
    f1 = [2 / 3, 2 * 0.5 * 1.0 / 1.5, 2 * 1.0 * 0.5 / 1.5]
    assert scores.f1[:3] == pytest.approx(f1)
    # The absent class 3 is left out of the average, as sklearn's macro F1 over seen labels.
    assert scores.macro_f1 == pytest.approx(np.mean(f1))
    assert scores.support == [3, 2, 4, 0]


def test_confusion_picture(tmp_path):
    matrix = confusion_matrix([0, 1, 1], [0, 1, 0], 2)
    path = plot_confusion(matrix, ["a", "b"], tmp_path / "c.png", "title")
    assert path.read_bytes()[:4] == b"\x89PNG"
