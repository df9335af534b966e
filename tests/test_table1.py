"""The counts of experiments/table1.py: the maximum path length that stacking real layers finds
is the one each layer's reach implies; the sequential operations counted on the real layers
are a constant for the batched layers and grow by one cell step per position for the LSTM;
the timed layers keep the sequence's shape."""

from __future__ import annotations

import math

import pytest
import torch
from experiments.table1 import LAYERS, build, path_length, sequential_operations


@pytest.mark.parametrize("n", [2, 5, 16, 37, 100])
def test_path_lengths_follow_each_layers_reach(n: int):
    window, kernel = 4, 3
    assert path_length("self-attention", n, window, kernel) == 1
    # A window of r on each side moves r positions a layer.
    assert path_length("restricted", n, window, kernel) == math.ceil((n - 1) / window)
    # A kernel of k, centred, moves (k - 1) / 2 positions a layer, in either layer kind.
    assert path_length("convolutional", n, window, kernel) == n - 1
    assert path_length("separable", n, window, kernel) == n - 1
    assert path_length("convolutional", n, window, 5) == math.ceil((n - 1) / 2)
    # Dilations 1, k, k², ...: k^L positions after L layers.
    dilated = path_length("convolutional", n, window, kernel, dilated=True)
    assert kernel ** (dilated - 1) < n <= kernel**dilated


def test_a_window_that_covers_the_sequence_is_one_layer():
    assert path_length("restricted", 9, 8, 3) == 1
    assert path_length("restricted", 10, 8, 3) == 2


@pytest.mark.parametrize("kind", LAYERS)
def test_each_timed_layer_maps_a_sequence_to_one_of_its_shape(kind: str):
    layer, module = build(kind, 16, 2, 4, 3)
    x = torch.randn(1, 11, 16, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())


def test_sequential_operations_are_counted_constant_for_batched_layers_and_n_for_the_lstm():
    window, kernel = 4, 3
    for kind in LAYERS:
        short, long = (sequential_operations(kind, n, window, kernel) for n in (5, 37))
        if kind == "recurrent":
            # the paper's O(n): each position's cell waits for the one before, the same
            # number of operators a step
            step = sequential_operations(kind, 6, window, kernel) - short
            assert step > 1
            assert long - short == 32 * step
        else:  # O(1): a few batched operators over all positions, whatever n
            assert 1 <= short == long <= 20
    # one projection, the fused attention kernel, the output projection
    assert sequential_operations("self-attention", 50, window, kernel) == 3
    assert sequential_operations("convolutional", 50, window, kernel) == 1
    assert sequential_operations("separable", 50, window, kernel) == 2
