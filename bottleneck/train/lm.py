"""Word-level language-model training and evaluation steps, jitted once, for any model.

:class:`LanguageModelTrainer` holds the model's graph definition and a :class:`LMTrainState`
pytree (parameters, optimizer state, the NT-ASGD average, counters) and runs:

* :meth:`~LanguageModelTrainer.train_step`: one step on a window: the model's training
  objective with dropout keyed by the seed and the step (so a resumed run draws the same
  masks), the optax update scaled by the window's ``lr_scale`` (AWD-LSTM's per-batch learning
  rate ``seq_len / bptt``), and, once NT-ASGD has switched, the running average of the iterates;
* :meth:`~LanguageModelTrainer.evaluate`: deterministic mean NLL over a batchified stream with
  the state carried across windows; optionally writing the full log-probabilities
  (:class:`LogProbBlockWriter`);
* :meth:`~LanguageModelTrainer.dynamic_evaluate`: dynamic evaluation
  (:mod:`bottleneck.train.dynamic_eval`).

The model (:class:`LanguageModel`) sees batch-major windows ``[B, T]`` and a ``carry`` passed
from each window to the next (truncated BPTT); a model without state returns ``None`` from
``initial_carry``. Windows vary in length (AWD-LSTM's sampling); each is padded up to a multiple
of ``bucket`` steps and given its true length (:func:`pad_window`), so only a handful of shapes
are ever compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from bottleneck.data.batching import BpttWindow, fixed_windows
from bottleneck.sharding import DATA, axis_size, replicate, shard_batch
from bottleneck.train import dynamic_eval
from bottleneck.train.nt_asgd import update_average


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


class LMTrainState(NamedTuple):
    """Everything a training step changes (a pytree; checkpoint it as a whole).

    Attributes:
      params: the model's ``nnx.Param`` state.
      opt_state: the optax state.
      average: running mean of the iterates since NT-ASGD switched (a copy of the
        parameters before that).
      num_averaged: int32, the number of iterates in ``average``.
      step: int32, optimizer steps taken (dropout keys fold it in).
    """

    params: Any
    opt_state: Any
    average: Any
    num_averaged: jax.Array
    step: jax.Array


class StepMetrics(NamedTuple):
    """Scalars of one training step (before its update): the objective and its NLL part."""

    loss: jax.Array
    nll: jax.Array


class LanguageModel(Protocol):
    """What :class:`LanguageModelTrainer` (and so the run loop) needs from a model.

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


class LanguageModelTrainer:
    """Jitted training / evaluation of any :class:`LanguageModel`.

    Args:
      model: the model; only its ``nnx.Param`` state is trained (it must hold no other state).
      tx: optax transformation (e.g. :func:`bottleneck.train.make_optimizer` with SGD, clipping
        and weight decay, or AdamW with a warmup-cosine schedule). Its updates are scaled by
        ``lr_scale`` each step.
      seed: dropout keys are ``fold_in(split(key(seed))[1], step)``.
      mesh: the ``("data", "vocab")`` mesh the model was built for and placed on
        (:func:`bottleneck.sharding.shard_model`): windows and carries are sharded on ``data``
        along their batch axis (replicated when the batch does not divide, e.g. a test batch
        of 1), and every step keeps the state's shardings.
    """

    def __init__(
        self,
        model: LanguageModel,
        tx: optax.GradientTransformation,
        *,
        seed: int = 0,
        mesh: Mesh | None = None,
    ):
        self.mesh = mesh
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("model must hold only nnx.Param state (no batch stats, no RNG state)")
        self.graphdef = graphdef
        # The steps donate the state: a copy keeps the caller's model usable.
        params = jax.tree.map(jnp.copy, params)
        self.state = LMTrainState(
            params=params,
            opt_state=tx.init(params),
            average=jax.tree.map(jnp.copy, params),
            num_averaged=jnp.zeros((), jnp.int32),
            step=jnp.zeros((), jnp.int32),
        )
        state_shardings = None
        if mesh is not None:  # scalars and optimizer counters live replicated on the mesh
            self.state = jax.tree.map(
                lambda x: x if isinstance(x.sharding, NamedSharding) else replicate(x, mesh),
                self.state,
            )
            state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
        # Not key(seed) itself: nnx.Rngs(seed) folds its counter into that key for the
        # initialisation, and the dropout keys must not repeat those draws.
        base_key = jax.random.split(jax.random.key(seed))[1]

        def train_step(
            state: LMTrainState,
            carry: Any,
            window: Window,
            lr_scale: jax.Array,
            averaging: jax.Array,
        ) -> tuple[LMTrainState, Any, StepMetrics]:
            key = jax.random.fold_in(base_key, state.step)

            def loss_fn(params: Any) -> tuple[jax.Array, Any]:
                model = nnx.merge(graphdef, params)
                return model.objective(
                    window.inputs, window.targets, carry, key=key, length=window.length
                )

            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            # AWD-LSTM sets lr * seq_len / bptt for the step; for SGD that scales the update.
            updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
            params = optax.apply_updates(state.params, updates)
            # A traced switch (not a static one) keeps one compiled step per window shape.
            average = jax.tree.map(
                lambda new, old: jnp.where(averaging, new, old),
                update_average(state.average, params, state.num_averaged),
                state.average,
            )
            num_averaged = state.num_averaged + averaging.astype(jnp.int32)
            new_state = LMTrainState(params, opt_state, average, num_averaged, state.step + 1)
            if state_shardings is not None:  # same layout every step: no drift, no recompiles
                new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
            return new_state, aux.carry, StepMetrics(loss, aux.nll)

        def eval_step(params: Any, carry: Any, window: Window) -> tuple[jax.Array, Any]:
            model = nnx.merge(graphdef, params)
            nll, carry = model.nll(window.inputs, window.targets, carry, length=window.length)
            return nll * _num_real(window).astype(nll.dtype), carry

        def log_probs_step(
            params: Any, carry: Any, window: Window
        ) -> tuple[jax.Array, jax.Array, Any]:
            model = nnx.merge(graphdef, params)
            log_probs, carry = model.log_probs(window.inputs, carry, length=window.length)
            picked = jnp.take_along_axis(log_probs, window.targets[..., None], axis=-1)[..., 0]
            nll_sum = -jnp.sum(jnp.where(_real_positions(window), picked, 0.0))
            return log_probs, nll_sum, carry

        self._segment_grad = functools.partial(_segment_grad, graphdef)
        self._train_step = jax.jit(train_step, donate_argnums=0)
        self._eval_step = jax.jit(eval_step)
        self._log_probs_step = jax.jit(log_probs_step)

    @property
    def model(self) -> LanguageModel:
        """The model with the current parameters (a fresh NNX object)."""
        return nnx.merge(self.graphdef, self.state.params)

    def initial_carry(self, batch_size: int) -> Any:
        return self._place(self.model.initial_carry(batch_size))

    def _place(self, tree: Any) -> Any:
        """On a mesh: arrays sharded on ``data`` along axis 0 (the batch) if it divides, else
        replicated."""
        if self.mesh is None:
            return tree

        def place(x: Any) -> Any:
            if np.ndim(x) > 0 and np.shape(x)[0] % axis_size(self.mesh, DATA) == 0:
                return shard_batch(x, self.mesh, axis=0)
            return replicate(x, self.mesh)

        return jax.tree.map(place, tree)

    def _place_windows(self, windows: Iterable[Window]) -> Iterator[Window]:
        return (self._place(window) for window in windows)

    def train_step(
        self, carry: Any, window: Window, lr_scale: float, *, averaging: bool
    ) -> tuple[Any, StepMetrics]:
        """One optimizer step on ``window``; returns the next window's carry and the metrics.

        Args:
          carry: state after the previous window (gradients never flow into it: truncated BPTT).
          window: the padded window.
          lr_scale: multiplies the update (``seq_len / bptt``).
          averaging: NT-ASGD has switched: fold the new iterate into the average.
        """
        self.state, carry, metrics = self._train_step(
            self.state,
            carry,
            self._place(window),
            jnp.float32(lr_scale),
            jnp.bool_(averaging),
        )
        return carry, metrics

    def evaluate(
        self,
        params: Any,
        batched: np.ndarray,
        seq_len: int,
        *,
        writer: LogProbBlockWriter | None = None,
        on_window: Callable[[], Any] | None = None,
    ) -> float:
        """Mean NLL per token over a batchified stream ``[num_steps, B]``, state carried.

        Args:
          params: parameters to evaluate (e.g. ``state.params`` or ``state.average``).
          batched: from :func:`bottleneck.data.batchify`.
          seq_len: window length (AWD-LSTM evaluates with ``bptt``).
          writer: if given, the full log-probabilities of the rows go there (row order: window,
            then time step, then sequence in the batch, whatever the model's layout) until it
            is full.
          on_window: called after each window (progress bars, interruption checks).
        """
        carry = self.initial_carry(batched.shape[1])
        total, tokens = jnp.zeros((), jnp.float32), 0
        for window in self._place_windows(eval_windows(batched, seq_len)):
            if writer is not None and not writer.full:
                log_probs, nll_sum, carry = self._log_probs_step(params, carry, window)
                rows = int(window.length) * batched.shape[1]
                writer.add(
                    np.swapaxes(np.asarray(log_probs), 0, 1).reshape(-1, log_probs.shape[-1])[
                        :rows
                    ],
                    np.asarray(window.targets).T.reshape(-1)[:rows],
                )
            else:
                nll_sum, carry = self._eval_step(params, carry, window)
            total = total + nll_sum
            tokens += int(window.length) * batched.shape[1]
            if on_window is not None:
                on_window()
        if tokens == 0:
            raise ValueError(f"batched has no targets: shape {batched.shape}")
        return float(total) / tokens

    def dynamic_evaluate(
        self,
        params: Any,
        train_windows: Iterable[Window],
        eval_batched: np.ndarray,
        *,
        stats_batch_size: int,
        segment: int,
        lr: float,
        lamb: float,
        epsilon: float,
        style: str,
        max_batches: int | None = None,
        stats: dynamic_eval.GradientStatistics | None = None,
        on_window: Callable[[], Any] | None = None,
    ) -> tuple[float, dynamic_eval.GradientStatistics]:
        """Dynamic evaluation of ``params`` on ``eval_batched`` (Krause et al.; Yang et al.).

        Gradient statistics come from ``train_windows`` (batch ``stats_batch_size``) unless
        ``stats`` from an earlier call are given. The evaluation stream is scored segment by
        segment (``segment`` rows), each scored before the update on it.

        Returns:
          Mean NLL per token and the gradient statistics (to reuse on another split).
        """
        if stats is None:
            stats = dynamic_eval.collect_gradient_statistics(
                self._segment_grad,
                params,
                self._place_windows(train_windows),
                self.initial_carry(stats_batch_size),
                lamb=lamb,
                style=style,
                max_batches=max_batches,
                on_batch=on_window,
            )
        nll, _ = dynamic_eval.dynamic_evaluate(
            self._segment_grad,
            params,
            self._place_windows(eval_windows(eval_batched, segment)),
            self.initial_carry(eval_batched.shape[1]),
            stats,
            lr=lr,
            lamb=lamb,
            epsilon=epsilon,
            on_batch=on_window,
        )
        return nll, stats


def _real_positions(window: Window) -> jax.Array:
    """``[B, L]`` booleans: the window's real (unpadded) positions."""
    steps = jnp.arange(window.inputs.shape[1], dtype=jnp.int32)
    return jnp.broadcast_to(steps < window.length, window.inputs.shape)


def _num_real(window: Window) -> jax.Array:
    return window.length * window.inputs.shape[0]


def _segment_grad(
    graphdef: nnx.GraphDef, params: Any, carry: Any, window: Window
) -> tuple[tuple[jax.Array, jax.Array, Any], Any]:
    """Deterministic NLL sum, token count, next carry, and the gradient of the mean NLL."""

    def mean_nll(params: Any) -> tuple[jax.Array, Any]:
        model = nnx.merge(graphdef, params)
        return model.nll(window.inputs, window.targets, carry, length=window.length)

    (nll, carry), grads = jax.value_and_grad(mean_nll, has_aux=True)(params)
    count = _num_real(window)
    return (nll * count.astype(nll.dtype), count, carry), grads
