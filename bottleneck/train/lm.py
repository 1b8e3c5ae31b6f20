"""What the trainer needs of a language model and its windows, and where log-probs go.

The model (:class:`LanguageModel`) sees batch-major windows ``[B, T]`` and a ``carry`` passed
from each window to the next (truncated BPTT); a model without state returns ``None`` from
``initial_carry``. Windows vary in length (AWD-LSTM's sampling); each is padded up to a multiple
of ``bucket`` steps and given its true length (:func:`pad_window`), so only a handful of shapes
are ever compiled. :class:`LogProbBlockWriter` keeps an evaluation's full log-probabilities.
The steps and the trainer that runs them are :mod:`bottleneck.train.steps`'.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from bottleneck.data.batching import BpttWindow, fixed_windows


class Window(NamedTuple):
    """A window padded to a compiled length, batch-major.

    Attributes:
      inputs: ``[B, L]`` int32 token ids (columns ``>= length`` are padding).
      targets: ``[B, L]`` int32 next-token ids.
      length: int32 scalar, the real number of time steps.
    """

    inputs: jax.Array
    targets: jax.Array
    length: jax.Array


def padded_length(seq_len: int, bucket: int) -> int:
    """``seq_len`` rounded up to a multiple of ``bucket``."""
    if seq_len < 1 or bucket < 1:
        raise ValueError(f"seq_len and bucket must be >= 1, got {seq_len} and {bucket}")
    return -(-seq_len // bucket) * bucket


def pad_window(window: BpttWindow, length: int) -> Window:
    """A :class:`~bottleneck.data.BpttWindow` ``[seq_len, B]`` as a batch-major :class:`Window`
    ``[B, length]``, zero-padded after its ``seq_len`` steps."""
    if length < window.seq_len:
        raise ValueError(f"length must be >= the window's seq_len {window.seq_len}, got {length}")
    padding = ((0, 0), (0, length - window.seq_len))
    return Window(
        inputs=np.pad(np.asarray(window.inputs, np.int32).T, padding),
        targets=np.pad(np.asarray(window.targets, np.int32).T, padding),
        length=np.int32(window.seq_len),
    )


def eval_windows(batched: np.ndarray, seq_len: int) -> Iterator[Window]:
    """:func:`~bottleneck.data.fixed_windows`, every window padded to ``seq_len`` (one shape)."""
    for window in fixed_windows(batched, seq_len):
        yield pad_window(window, seq_len)


def num_eval_windows(batched: np.ndarray, seq_len: int) -> int:
    """How many windows :func:`eval_windows` yields."""
    return len(range(0, batched.shape[0] - 1, seq_len))


class LanguageModel(Protocol):
    """What :class:`~bottleneck.train.Trainer` (and so the run loop) needs from a model.

    An ``nnx.Module`` holding only ``nnx.Param`` state. Every method takes batch-major token ids
    ``[B, T]`` of a window padded after its first ``length`` steps (``length``: int32 scalar;
    positions from ``length`` on must not count, nor change the carry), and the ``carry`` from the
    previous window of the same stream (from :meth:`initial_carry` for the first).
    :class:`bottleneck.nn.awd_lstm.AWDLSTMLanguageModel` is the AWD-LSTM's,
    :class:`bottleneck.nn.transformer.TransformerLanguageModel` the Transformer's (stateless).
    """

    def initial_carry(self, batch_size: int) -> Any:
        """The state before a stream's first window: a pytree with batch-leading arrays, or
        ``None`` for a model that carries nothing between windows (a Transformer)."""

    def objective(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        carry: Any,
        *,
        key: jax.Array,
        length: jax.Array,
    ) -> tuple[jax.Array, Any]:
        """Training loss of one window with dropout drawn from ``key`` (regularisers included),
        and an aux value with ``.nll`` (the mean NLL part) and ``.carry`` (for the next window)."""

    def nll(
        self, tokens: jax.Array, targets: jax.Array, carry: Any, *, length: jax.Array
    ) -> tuple[jax.Array, Any]:
        """Deterministic mean NLL of the real positions (evaluation) and the next carry."""

    def log_probs(
        self, tokens: jax.Array, carry: Any, *, length: jax.Array
    ) -> tuple[jax.Array, Any]:
        """Deterministic next-token log-probabilities ``[B, T, M]`` and the next carry."""


class LogProbBlockWriter:
    """Writes rows of log-probabilities as ``.npy`` blocks ``[T_i, M]`` into a folder.

    The format read by ``experiments/rank.py --mode model --log_probs FOLDER``: files sorted by
    name, stacked along rows. Rows arrive in evaluation order and are cut into blocks of
    ``block_rows``; rows beyond ``max_rows`` are dropped.

    Args:
      directory: the output folder (created; old ``block_*.npy`` files are removed).
      block_rows: rows per file.
      max_rows: total rows to keep (``None``: all).
    """

    def __init__(self, directory: str | Path, *, block_rows: int, max_rows: int | None = None):
        if block_rows < 1:
            raise ValueError(f"block_rows must be >= 1, got {block_rows}")
        if max_rows is not None and max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 or None, got {max_rows}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("block_*.npy"):
            stale.unlink()
        self.block_rows, self.max_rows = block_rows, max_rows
        self.rows_written = 0
        self.files: list[Path] = []
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._targets: list[np.ndarray] = []

    @property
    def full(self) -> bool:
        return self.max_rows is not None and self.rows_written + self._pending_rows >= self.max_rows

    def add(self, log_probs: np.ndarray, targets: np.ndarray) -> None:
        """Appends rows ``log_probs [N, M]`` (float32) with their targets ``[N]``."""
        if self.max_rows is not None:
            room = self.max_rows - self.rows_written - self._pending_rows
            log_probs, targets = log_probs[:room], targets[:room]
        self._pending.append(np.asarray(log_probs, np.float32))
        self._targets.append(np.asarray(targets, np.int32))
        self._pending_rows += len(log_probs)
        while self._pending_rows >= self.block_rows:
            self._flush(self.block_rows)

    def _flush(self, rows: int) -> None:
        pending = np.concatenate(self._pending, axis=0)
        block, rest = pending[:rows], pending[rows:]
        path = self.directory / f"block_{len(self.files):05d}.npy"
        np.save(path, block)
        self.files.append(path)
        self.rows_written += len(block)
        self._pending, self._pending_rows = ([rest] if len(rest) else []), len(rest)

    def close(self) -> np.ndarray:
        """Writes the last partial block; returns the targets of all written rows ``[T]``."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        return np.concatenate(self._targets) if self._targets else np.zeros((0,), np.int32)


def real_positions(window: Window) -> jax.Array:
    """``[B, L]`` booleans: the window's real (unpadded) positions."""
    steps = jnp.arange(window.inputs.shape[1], dtype=jnp.int32)
    return jnp.broadcast_to(steps < window.length, window.inputs.shape)
