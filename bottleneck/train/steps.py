"""One trainer for every experiment: a state pytree, pure step functions, :class:`Trainer`.

A model is split once into its graph definition and its ``nnx.Param`` state; what training
changes is a :class:`TrainState` pytree (parameters, optax state, NT-ASGD's running average,
step count), checkpointed as a whole. The steps are pure, unjitted functions of that state (the
library's convention: callers jit), so each can be tested, traced or lowered on its own:

* :func:`train_step` / :func:`train_steps`: one step (or a compiled loop of steps on one batch)
  on ``loss_fn(model, batch) -> scalar`` (the synthetic study, a head on fixed inputs);
* :func:`window_step`: one language-model step on a padded :class:`~bottleneck.train.lm.Window`:
  the model's objective with dropout keyed by the step (a resumed run draws the same masks), the
  update scaled by the window's ``lr_scale`` (AWD-LSTM's ``seq_len / bptt``) and, once NT-ASGD
  averages, the running average of the iterates;
* :func:`eval_step`, :func:`log_probs_step`, :func:`segment_grad`: deterministic NLL sums,
  log-probabilities, and the gradient dynamic evaluation needs.

:class:`Trainer` binds them to one model and optimizer and jits each where it calls it, with
``jax.jit``: the training steps donate the state they replace (its buffers are reused, so a step
holds one copy of the parameters and optimizer state); the evaluation steps read parameters that
are evaluated window after window, so they donate nothing. ``jax.jit`` over the split state
rather than ``nnx.jit`` over the module: the state is a plain pytree, so a hot loop pays no NNX
graph traversal per call and donation is JAX's own; the model is merged back only when asked for
(:attr:`Trainer.model`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from bottleneck.data.batching import BpttWindow
from bottleneck.nn.pieces import PLIF_SLOPES_LABEL, param_labels
from bottleneck.sharding import DATA, axis_size, replicate, shard_batch
from bottleneck.train import dynamic_eval
from bottleneck.train.lm import (
    LogProbBlockWriter,
    Window,
    eval_windows,
    pad_window,
    padded_length,
    real_positions,
)
from bottleneck.train.nt_asgd import update_average


def make_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    optimizer: str = "adam",
    plif_learning_rate: float | optax.Schedule | None = None,
    grad_clip_norm: float | None = None,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """An optax transformation, optionally with its own learning rate for PLIF slopes.

    Args:
      learning_rate: for all parameters (but PLIF slopes when ``plif_learning_rate`` is set); a
        number or an optax schedule of the step count.
      optimizer: ``"adam"``, ``"sgd"`` or ``"adamw"``.
      plif_learning_rate: separate rate (or schedule) for the ``raw_slopes`` parameters (Ganea
        et al. use 0.02); labels come from :func:`bottleneck.nn.param_labels`.
      grad_clip_norm: clip the global gradient norm first (0.25 in Merity et al.).
      weight_decay: for ``"sgd"`` / ``"adam"`` an L2 penalty added to the gradient (PyTorch-SGD
        style, as AWD-LSTM); for ``"adamw"`` decoupled decay (Loshchilov & Hutter 2019) of the
        matrices only (``ndim >= 2``: projections and embeddings, as GPT-2 training does), not
        of biases, norm scales or PLIF slopes.
    """
    if optimizer not in ("adam", "sgd", "adamw"):
        raise ValueError(f"optimizer must be one of adam, adamw, sgd, got {optimizer!r}")

    def with_rate(rate: float | optax.Schedule) -> optax.GradientTransformation:
        if optimizer == "adamw":
            return optax.adamw(rate, weight_decay=weight_decay, mask=_matrices)
        steps = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
        return optax.chain(*steps, {"adam": optax.adam, "sgd": optax.sgd}[optimizer](rate))

    tx = with_rate(learning_rate)
    if plif_learning_rate is not None:
        tx = optax.multi_transform(
            {"default": tx, PLIF_SLOPES_LABEL: with_rate(plif_learning_rate)}, param_labels
        )
    if grad_clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
    return tx


def _matrices(params: Any) -> Any:
    """AdamW's decay mask: True for the parameters with two or more axes."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


class TrainState(NamedTuple):
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


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    """The state before the first step: fresh copies of ``params`` (the steps donate theirs)."""
    params = jax.tree.map(jnp.copy, params)
    counters = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)  # two buffers: both donated
    return TrainState(params, tx.init(params), jax.tree.map(jnp.copy, params), *counters)


class StepMetrics(NamedTuple):
    """Scalars of one training step (before its update): the objective and its NLL part."""

    loss: jax.Array
    nll: jax.Array


def apply_gradients(
    tx: optax.GradientTransformation,
    state: TrainState,
    grads: Any,
    *,
    lr_scale: jax.Array | None = None,
    averaging: jax.Array | None = None,
) -> TrainState:
    """The optax update of ``state.params`` by ``grads``, the step count advanced.

    Args:
      lr_scale: multiplies the update (AWD-LSTM sets ``lr * seq_len / bptt`` for a step; for
        SGD that scales the update); ``None``: unscaled.
      averaging: a traced boolean (one compiled step whether or not NT-ASGD averages): fold the
        new iterate into ``state.average``; ``None``: the average is left as it is.
    """
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    if lr_scale is not None:
        updates = jax.tree.map(lambda u: u * lr_scale.astype(u.dtype), updates)
    params = optax.apply_updates(state.params, updates)
    average, num_averaged = state.average, state.num_averaged
    if averaging is not None:
        average = jax.tree.map(
            lambda new, old: jnp.where(averaging, new, old),
            update_average(average, params, num_averaged),
            average,
        )
        num_averaged = num_averaged + averaging.astype(jnp.int32)
    return TrainState(params, opt_state, average, num_averaged, state.step + 1)


def train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: Callable[[Any, Any], jax.Array],
    state: TrainState,
    batch: Any,
) -> tuple[TrainState, jax.Array]:
    """One optimizer step on ``loss_fn(model, batch) -> scalar``; returns the new state and the
    loss before the update (``model = nnx.merge(graphdef, state.params)``)."""
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(state.params)
    return apply_gradients(tx, state, grads), loss


def train_steps(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: Callable[[Any, Any], jax.Array],
    state: TrainState,
    batch: Any,
    num_steps: int,
) -> tuple[TrainState, jax.Array]:
    """``num_steps`` :func:`train_step` s on the same ``batch`` (full-batch training) as one
    ``lax.scan`` (``num_steps`` static); returns the ``[num_steps]`` losses too."""
    step = functools.partial(train_step, graphdef, tx, loss_fn)
    return jax.lax.scan(lambda s, _: step(s, batch), state, None, length=num_steps)


def window_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    base_key: jax.Array,
    state: TrainState,
    carry: Any,
    window: Window,
    lr_scale: jax.Array,
    averaging: jax.Array,
    *,
    shardings: Any = None,
) -> tuple[TrainState, Any, StepMetrics]:
    """One language-model step (a :class:`~bottleneck.train.lm.LanguageModel`) on ``window``.

    The loss is ``model.objective`` with dropout from ``fold_in(base_key, state.step)``;
    gradients never flow into ``carry`` (truncated BPTT). The update is scaled by ``lr_scale``
    and, where ``averaging``, folded into the running average (:func:`apply_gradients`).
    ``shardings`` (a pytree like ``state``) pins the new state's layout: no drift, no recompiles.

    Returns:
      The new state, the next window's carry, and the :class:`StepMetrics` before the update.
    """
    key = jax.random.fold_in(base_key, state.step)

    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        model = nnx.merge(graphdef, params)
        return model.objective(window.inputs, window.targets, carry, key=key, length=window.length)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = apply_gradients(tx, state, grads, lr_scale=lr_scale, averaging=averaging)
    if shardings is not None:
        new_state = jax.lax.with_sharding_constraint(new_state, shardings)
    return new_state, aux.carry, StepMetrics(loss, aux.nll)


def _num_real(window: Window) -> jax.Array:
    return window.length * window.inputs.shape[0]


def eval_step(
    graphdef: nnx.GraphDef, params: Any, carry: Any, window: Window
) -> tuple[jax.Array, Any]:
    """The deterministic NLL *sum* over the window's real positions, and the next carry."""
    model = nnx.merge(graphdef, params)
    nll, carry = model.nll(window.inputs, window.targets, carry, length=window.length)
    return nll * _num_real(window).astype(nll.dtype), carry


def log_probs_step(
    graphdef: nnx.GraphDef, params: Any, carry: Any, window: Window
) -> tuple[jax.Array, jax.Array, Any]:
    """The window's log-probabilities ``[B, L, M]``, their NLL sum over the real positions
    (as :func:`eval_step`'s), and the next carry."""
    model = nnx.merge(graphdef, params)
    log_probs, carry = model.log_probs(window.inputs, carry, length=window.length)
    picked = jnp.take_along_axis(log_probs, window.targets[..., None], axis=-1)[..., 0]
    return log_probs, -jnp.sum(jnp.where(real_positions(window), picked, 0.0)), carry


def segment_grad(
    graphdef: nnx.GraphDef, params: Any, carry: Any, window: Window
) -> tuple[tuple[jax.Array, jax.Array, Any], Any]:
    """Deterministic NLL sum, token count, next carry, and the gradient of the mean NLL
    (:mod:`~bottleneck.train.dynamic_eval`'s ``segment_grad`` once ``graphdef`` is bound)."""

    def mean_nll(params: Any) -> tuple[jax.Array, Any]:
        model = nnx.merge(graphdef, params)
        return model.nll(window.inputs, window.targets, carry, length=window.length)

    (nll, carry), grads = jax.value_and_grad(mean_nll, has_aux=True)(params)
    count = _num_real(window)
    return (nll * count.astype(nll.dtype), count, carry), grads


class Trainer:
    """A model and its optimizer: the step functions above, jitted once, the state donated.

    Train with :meth:`step` / :meth:`run` (a ``loss_fn``) or, for a
    :class:`~bottleneck.train.lm.LanguageModel`, :meth:`window_step`, :meth:`evaluate` and
    :meth:`dynamic_evaluate` (the run loop, :mod:`bottleneck.runs.run_loop`).

    Args:
      model: an NNX module holding only ``nnx.Param`` state; it is left as it is (the steps
        donate a copy): read the trained model from :attr:`model`.
      tx: optax transformation (e.g. :func:`make_optimizer`, or AdamW with a warmup-cosine
        schedule). :meth:`window_step` scales its updates by ``lr_scale``.
      loss_fn: ``loss_fn(model, batch) -> scalar`` for :meth:`step` and :meth:`run`.
      seed: dropout keys of :meth:`window_step` are ``fold_in(split(key(seed))[1], step)``.
      mesh: the ``("data", "vocab")`` mesh the model was built for and placed on
        (:func:`bottleneck.sharding.shard_model`): windows and carries are sharded on ``data``
        along their batch axis (replicated when the batch does not divide, e.g. a test batch
        of 1), and every window step keeps the state's shardings.

    Attributes:
      state: the :class:`TrainState` (assign a restored one to resume).
      graphdef: the model's graph definition.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        loss_fn: Callable[[Any, Any], jax.Array] | None = None,
        *,
        seed: int = 0,
        mesh: Mesh | None = None,
    ):
        self.mesh = mesh
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("model must hold only nnx.Param state (no batch stats, no RNG state)")
        self.graphdef = graphdef
        self.state = init_state(params, tx)
        shardings = None
        if mesh is not None:  # scalars and optimizer counters live replicated on the mesh
            self.state = jax.tree.map(
                lambda x: x if isinstance(x.sharding, NamedSharding) else replicate(x, mesh),
                self.state,
            )
            shardings = jax.tree.map(lambda x: x.sharding, self.state)
        # Not key(seed) itself: nnx.Rngs(seed) folds its counter into that key for the
        # initialisation, and the dropout keys must not repeat those draws.
        base_key = jax.random.split(jax.random.key(seed))[1]
        bind = functools.partial
        if loss_fn is not None:
            self._train_step = jax.jit(bind(train_step, graphdef, tx, loss_fn), donate_argnums=0)
            self._train_steps = jax.jit(
                bind(train_steps, graphdef, tx, loss_fn), donate_argnums=0, static_argnums=2
            )
        self._window_step = jax.jit(
            bind(window_step, graphdef, tx, base_key, shardings=shardings), donate_argnums=0
        )
        self._eval_step = jax.jit(bind(eval_step, graphdef))
        self._log_probs_step = jax.jit(bind(log_probs_step, graphdef))
        self._segment_grad = bind(segment_grad, graphdef)

    @property
    def model(self) -> Any:
        """The model with the current parameters (a fresh NNX object)."""
        return nnx.merge(self.graphdef, self.state.params)

    def step(self, batch: Any) -> jax.Array:
        """One optimizer step on ``batch``; returns the loss before the update."""
        self.state, loss = self._train_step(self.state, batch)
        return loss

    def run(self, batch: Any, num_steps: int) -> jax.Array:
        """``num_steps`` steps on the same ``batch`` (full-batch training) in one compiled loop.

        Returns the ``[num_steps]`` losses, each before its update.
        """
        self.state, losses = self._train_steps(self.state, batch, num_steps)
        return losses

    def window_step(
        self, carry: Any, window: Window, lr_scale: float, *, averaging: bool
    ) -> tuple[Any, StepMetrics]:
        """One language-model step on ``window`` (:func:`window_step`); returns the next
        window's carry and the metrics.

        Args:
          carry: state after the previous window (gradients never flow into it).
          window: the padded window.
          lr_scale: multiplies the update (``seq_len / bptt``).
          averaging: NT-ASGD has switched: fold the new iterate into the average.
        """
        self.state, carry, metrics = self._window_step(
            self.state, carry, self._place(window), jnp.float32(lr_scale), jnp.bool_(averaging)
        )
        return carry, metrics

    def train_windows(
        self, carry: Any, windows: Iterable[BpttWindow], *, bucket: int, averaging: bool = False
    ) -> Iterator[tuple[Any, BpttWindow, StepMetrics]]:
        """:meth:`window_step` on each window, padded up to a multiple of ``bucket`` steps
        (:func:`~bottleneck.train.lm.pad_window`), the carry passed on; yields the carry after
        each window, the window and its metrics."""
        for window in windows:
            padded = pad_window(window, padded_length(window.seq_len, bucket))
            carry, metrics = self.window_step(carry, padded, window.lr_scale, averaging=averaging)
            yield carry, window, metrics

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
