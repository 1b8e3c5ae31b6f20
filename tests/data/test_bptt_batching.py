"""BPTT batching against a plain transcription of AWD-LSTM's ``batchify`` / training loop."""

from __future__ import annotations

import numpy as np
import pytest

from bottleneck.data import BpttWindow, batchify, bptt_windows, fixed_windows
from bottleneck.data.batching import sample_seq_len


def reference_batchify(ids: np.ndarray, batch_size: int) -> np.ndarray:
    """Element by element: column ``j`` holds the ``j``-th contiguous chunk of the stream."""
    num_steps = len(ids) // batch_size
    batched = np.empty((num_steps, batch_size), ids.dtype)
    for step in range(num_steps):
        for column in range(batch_size):
            batched[step, column] = ids[column * num_steps + step]
    return batched


def reference_training_windows(batched: np.ndarray, bptt: int, seed: int) -> list[tuple]:
    """AWD-LSTM's ``train()`` loop and ``get_batch``, with ``max_seq_len_delta`` = 20."""
    rng = np.random.default_rng(seed)
    windows, i = [], 0
    while i < batched.shape[0] - 1 - 1:
        mean = bptt if rng.random() < 0.95 else bptt / 2.0
        seq_len = max(5, int(rng.normal(mean, 5)))
        seq_len = min(seq_len, bptt + 20)
        lr_scale = seq_len / bptt
        cut_len = min(seq_len, batched.shape[0] - 1 - i)
        windows.append((batched[i : i + cut_len], batched[i + 1 : i + 1 + cut_len], lr_scale))
        i += seq_len
    return windows


def test_batchify_matches_reference_and_trims_remainder() -> None:
    ids = np.arange(103, dtype=np.int32)
    batched = batchify(ids, batch_size=4)
    assert batched.shape == (25, 4) and batched.dtype == np.int32
    np.testing.assert_array_equal(batched, reference_batchify(ids, 4))
    np.testing.assert_array_equal(batched[:, 1], np.arange(25, 50))


def test_batchify_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        batchify(np.zeros((2, 3), np.int32), 2)
    with pytest.raises(ValueError, match="positive"):
        batchify(np.zeros(6, np.int32), 0)


@pytest.mark.parametrize(
    ("num_tokens", "batch_size", "bptt", "seed"), [(10_000, 8, 70, 0), (997, 3, 35, 7)]
)
def test_bptt_windows_match_reference_loop(num_tokens, batch_size, bptt, seed) -> None:
    batched = batchify(np.arange(num_tokens, dtype=np.int32), batch_size)
    windows = list(bptt_windows(batched, bptt, np.random.default_rng(seed)))
    expected = reference_training_windows(batched, bptt, seed)
    assert len(windows) == len(expected) > 1
    for window, (inputs, targets, lr_scale) in zip(windows, expected, strict=True):
        assert isinstance(window, BpttWindow)
        np.testing.assert_array_equal(window.inputs, inputs)
        np.testing.assert_array_equal(window.targets, targets)
        assert window.seq_len == inputs.shape[0] and window.lr_scale == lr_scale


def test_bptt_windows_tile_the_stream_with_shifted_targets() -> None:
    batched = batchify(np.arange(5_000, dtype=np.int32), 4)
    windows = list(bptt_windows(batched, 30, np.random.default_rng(1)))
    np.testing.assert_array_equal(np.concatenate([w.inputs for w in windows]), batched[:-1])
    np.testing.assert_array_equal(np.concatenate([w.targets for w in windows]), batched[1:])
    assert all(w.seq_len >= 5 for w in windows[:-1])


def test_bptt_windows_are_determined_by_the_seed() -> None:
    batched = batchify(np.arange(5_000, dtype=np.int32), 4)
    lengths = [
        [w.seq_len for w in bptt_windows(batched, 30, np.random.default_rng(seed))]
        for seed in (3, 3, 4)
    ]
    assert lengths[0] == lengths[1] != lengths[2]


def test_sample_seq_len_distribution_and_bounds() -> None:
    rng = np.random.default_rng(0)
    lengths = np.array([sample_seq_len(rng, 70) for _ in range(20_000)])
    assert lengths.min() >= 5 and lengths.max() <= 90
    half_bptt_fraction = np.mean(lengths < 52)
    assert 0.04 < half_bptt_fraction < 0.06
    assert abs(np.mean(lengths[lengths >= 52]) - 69.5) < 0.2  # int() truncates: mean - 0.5


def test_sample_seq_len_clips_to_min_and_max() -> None:
    rng = np.random.default_rng(0)
    lengths = [sample_seq_len(rng, 10, max_seq_len_delta=2) for _ in range(2_000)]
    assert min(lengths) == 5 and max(lengths) == 12


def test_fixed_windows_cover_every_target_once() -> None:
    batched = batchify(np.arange(1_001, dtype=np.int32), 5)
    windows = list(fixed_windows(batched, 35))
    assert [w.seq_len for w in windows] == [35] * 5 + [24]
    assert all(w.lr_scale == 1.0 for w in windows)
    np.testing.assert_array_equal(np.concatenate([w.targets for w in windows]), batched[1:])
