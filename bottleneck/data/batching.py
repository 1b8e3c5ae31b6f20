"""Batching for truncated backpropagation through time, as in AWD-LSTM (Merity et al. 2017).

A flat token stream is cut into ``batch_size`` contiguous columns (:func:`batchify`); training walks
down the rows in windows whose length is resampled every step (:func:`bptt_windows`), evaluation in
fixed-length windows (:func:`fixed_windows`). Targets are the inputs shifted by one row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np


class BpttWindow(NamedTuple):
    """One window of a batchified stream.

    Attributes:
        inputs: token ids, shape ``[seq_len, batch_size]``.
        targets: the next token of each input, shape ``[seq_len, batch_size]``.
        seq_len: ``inputs.shape[0]`` (the final window may be shorter than sampled).
        lr_scale: multiply the learning rate by this for the step: sampled length / ``bptt``
            (as in AWD-LSTM, the sampled length, even where the final window is cut short).
    """

    inputs: np.ndarray
    targets: np.ndarray
    seq_len: int
    lr_scale: float


def batchify(ids: np.ndarray, batch_size: int) -> np.ndarray:
    """Cuts a token stream into ``batch_size`` contiguous columns, dropping the remainder.

    Args:
        ids: token ids, shape ``[num_tokens]``.
        batch_size: number of columns.

    Returns:
        Shape ``[num_tokens // batch_size, batch_size]``; column ``j`` is
        ``ids[j * num_steps:(j + 1) * num_steps]``.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids must have shape [num_tokens], got shape {ids.shape}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    num_steps = ids.shape[0] // batch_size
    return np.ascontiguousarray(ids[: num_steps * batch_size].reshape(batch_size, num_steps).T)


def _window(batched: np.ndarray, start: int, seq_len: int, lr_scale: float) -> BpttWindow:
    """Rows ``start .. start + seq_len`` and their targets, cut at the last row with a target."""
    seq_len = min(seq_len, batched.shape[0] - 1 - start)
    return BpttWindow(
        inputs=batched[start : start + seq_len],
        targets=batched[start + 1 : start + 1 + seq_len],
        seq_len=seq_len,
        lr_scale=lr_scale,
    )


def sample_seq_len(
    rng: np.random.Generator,
    bptt: int,
    *,
    full_bptt_prob: float = 0.95,
    seq_len_std: float = 5.0,
    min_seq_len: int = 5,
    max_seq_len_delta: int = 20,
) -> int:
    """One AWD-LSTM window length.

    The mean is ``bptt`` with probability ``full_bptt_prob``, else ``bptt / 2``; the length is
    ``int(normal(mean, seq_len_std))`` (truncated towards zero), at least ``min_seq_len`` and at
    most ``bptt + max_seq_len_delta``. Draws ``rng.random()`` then ``rng.normal()``.
    """
    mean = bptt if rng.random() < full_bptt_prob else bptt / 2
    seq_len = max(min_seq_len, int(rng.normal(mean, seq_len_std)))
    return min(seq_len, bptt + max_seq_len_delta)


def bptt_windows(
    batched: np.ndarray,
    bptt: int,
    rng: np.random.Generator,
    *,
    full_bptt_prob: float = 0.95,
    seq_len_std: float = 5.0,
    min_seq_len: int = 5,
    max_seq_len_delta: int = 20,
) -> Iterator[BpttWindow]:
    """Training windows of variable length over a batchified stream, one epoch.

    Follows AWD-LSTM's training loop: while ``start < num_steps - 2``, sample a length with
    :func:`sample_seq_len`, yield the window at ``start`` and advance ``start`` by that length.

    Args:
        batched: token ids, shape ``[num_steps, batch_size]`` (see :func:`batchify`).
        bptt: the mean window length.
        rng: the source of randomness (e.g. ``np.random.default_rng(seed)``).
        full_bptt_prob, seq_len_std, min_seq_len, max_seq_len_delta: see :func:`sample_seq_len`.

    Yields:
        :class:`BpttWindow` with inputs and targets of shape ``[seq_len, batch_size]``.
    """
    start = 0
    while start < batched.shape[0] - 2:
        seq_len = sample_seq_len(
            rng,
            bptt,
            full_bptt_prob=full_bptt_prob,
            seq_len_std=seq_len_std,
            min_seq_len=min_seq_len,
            max_seq_len_delta=max_seq_len_delta,
        )
        yield _window(batched, start, seq_len, lr_scale=seq_len / bptt)
        start += seq_len


def fixed_windows(batched: np.ndarray, seq_len: int) -> Iterator[BpttWindow]:
    """Evaluation windows of ``seq_len`` rows (the last one shorter), covering every target once.

    Args:
        batched: token ids, shape ``[num_steps, batch_size]`` (see :func:`batchify`).
        seq_len: the window length.

    Yields:
        :class:`BpttWindow` with inputs and targets of shape ``[seq_len, batch_size]`` and
        ``lr_scale`` 1.
    """
    for start in range(0, batched.shape[0] - 1, seq_len):
        yield _window(batched, start, seq_len, lr_scale=1.0)
