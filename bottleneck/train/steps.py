"""Jitted optax training steps over an NNX model (shared by every experiment).

The model and its ``nnx.Optimizer`` are split once into a graph definition and a state pytree;
the step is a pure function of that state, jitted with the state donated, and merged back only
when the caller asks for the model. This avoids NNX's per-call graph traversal in hot loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bottleneck.nn.pieces import PLIF_SLOPES_LABEL, param_labels


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


class Trainer:
    """Owns a model and its optimizer state; ``step`` and ``run`` are jitted and donate state.

    Args:
      model: any NNX module; it is left as it is: read the trained model from :attr:`model`.
      tx: optax transformation for its ``nnx.Param`` s.
      loss_fn: ``loss_fn(model, batch) -> scalar`` to minimise.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        loss_fn: Callable[[Any, Any], jax.Array],
    ):
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self._graphdef, state = nnx.split((model, optimizer))
        # The steps donate their input state; copying once keeps the caller's arrays alive.
        self._state = jax.tree.map(jnp.copy, state)
        graphdef = self._graphdef

        def step(state: nnx.State, batch: Any) -> tuple[nnx.State, jax.Array]:
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

        def run(state: nnx.State, batch: Any, num_steps: int) -> tuple[nnx.State, jax.Array]:
            return jax.lax.scan(lambda s, _: step(s, batch), state, None, length=num_steps)

        self._step = jax.jit(step, donate_argnums=0)
        self._run = jax.jit(run, donate_argnums=0, static_argnums=2)

    def step(self, batch: Any) -> jax.Array:
        """One optimizer step on ``batch``; returns the loss before the update."""
        self._state, loss = self._step(self._state, batch)
        return loss

    def run(self, batch: Any, num_steps: int) -> jax.Array:
        """``num_steps`` steps on the same ``batch`` (full-batch training) in one compiled loop.

        Returns the ``[num_steps]`` losses, each before its update.
        """
        self._state, losses = self._run(self._state, batch, num_steps)
        return losses

    @property
    def model(self) -> Any:
        """The current model (a fresh NNX object merged from the trained state)."""
        return nnx.merge(self._graphdef, self._state)[0]

    @property
    def state(self) -> nnx.State:
        """The ``(model, optimizer)`` state pytree (for checkpoints)."""
        return self._state

    @state.setter
    def state(self, state: nnx.State) -> None:
        self._state = jax.tree.map(jnp.asarray, state)
