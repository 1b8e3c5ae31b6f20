r"""Dynamic evaluation (Krause et al. 2017/2018), the RMS-normalised update with decay to θ₀.

The model keeps learning while it is evaluated: the evaluation stream is cut into short segments;
each segment is first scored with the current parameters, then the parameters take one step on
that segment's loss

.. math::
   \theta \leftarrow \theta - \eta \frac{\nabla_\theta \mathcal{L}_s}{\mathrm{MS} + \epsilon}
          + \lambda \, r \odot (\theta_0 - \theta)

where ``MS`` is a per-parameter RMS of training gradients (collected once, before evaluating)
and ``r = MS / normaliser``, clipped at ``1 / lambda`` so that the decay never overshoots θ₀.

Two published normalisations, ``style``:

* ``"yang"``: Yang et al.'s ``dynamiceval.py`` for MoS (default without ``--ms``):
  ``MS = sqrt(sum_b g_b^2)`` and ``r = MS / sum_p mean(MS_p)``; lr 0.002, eps 0.001,
  lambda 0.075 (PTB) / 0.02 (WT2);
* ``"krause"``: Krause's ``dynamiceval.py`` used for AWD-LSTM by Kanai et al.:
  ``MS = sqrt(mean_b g_b^2)`` and ``r = MS / mean_p mean(MS_p)``; lr in [3e-5, 1e-4], lambda
  in [1e-3, 5e-3] (Kanai et al., App. C.1).

Here ``b`` runs over training batches and ``p`` over parameter arrays. The pure functions are
:func:`accumulate_squared_gradients`, :func:`gradient_statistics` and
:func:`dynamic_eval_update`; :func:`collect_gradient_statistics` and :func:`dynamic_evaluate`
run them over windows with any model given as a ``segment_grad`` function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

STYLES = ("yang", "krause")

# segment_grad(params, carry, window) -> ((nll_sum, count, new_carry), grads of the mean NLL)
SegmentGrad = Callable[[Any, Any, Any], tuple[tuple[jax.Array, jax.Array, Any], Any]]


class GradientStatistics(NamedTuple):
    """Per-parameter statistics of training gradients for :func:`dynamic_eval_update`.

    Attributes:
      rms: pytree like the parameters, ``MS`` (see the module docstring for ``style``).
      decay: pytree like the parameters, decay rates ``r`` clipped at ``1 / lambda``.
    """

    rms: Any
    decay: Any


def accumulate_squared_gradients(sum_squares: Any, grads: Any) -> Any:
    """``sum_squares + grads ** 2``, leaf by leaf."""
    return jax.tree.map(lambda s, g: s + jnp.square(g), sum_squares, grads)


def gradient_statistics(
    sum_squares: Any, num_batches: int, *, lamb: float, style: str = "yang"
) -> GradientStatistics:
    """``MS`` and clipped decay rates from summed squared gradients of ``num_batches`` batches.

    Args:
      sum_squares: pytree of ``sum_b g_b^2`` per parameter.
      num_batches: the number of batches summed (>= 1).
      lamb: the decay ``lambda`` (> 0); rates are clipped at ``1 / lambda``.
      style: ``"yang"`` or ``"krause"`` (module docstring).
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    if lamb <= 0:
        raise ValueError(f"lamb must be > 0, got {lamb}")
    if style == "krause":
        rms = jax.tree.map(lambda s: jnp.sqrt(s / num_batches), sum_squares)
    else:
        rms = jax.tree.map(jnp.sqrt, sum_squares)
    leaves = jax.tree.leaves(rms)
    normaliser = sum(jnp.mean(leaf) for leaf in leaves)
    if style == "krause":
        normaliser = normaliser / len(leaves)
    decay = jax.tree.map(lambda m: jnp.minimum(m / normaliser, 1.0 / lamb), rms)
    return GradientStatistics(rms, decay)


def dynamic_eval_update(
    params: Any,
    grads: Any,
    params0: Any,
    stats: GradientStatistics,
    *,
    lr: float | jax.Array,
    lamb: float | jax.Array,
    epsilon: float | jax.Array,
) -> Any:
    r"""One dynamic-evaluation step: ``θ - lr g / (MS + eps) + lamb r (θ₀ - θ)``.

    Args:
      params: current parameters θ (pytree).
      grads: gradient of the segment's mean loss at θ.
      params0: the parameters before dynamic evaluation started, θ₀.
      stats: ``MS`` and ``r`` from :func:`gradient_statistics`.
      lr, lamb, epsilon: η, λ, ε.

    Returns:
      The updated parameters.
    """

    def step(p: jax.Array, g: jax.Array, p0: jax.Array, ms: jax.Array, r: jax.Array) -> jax.Array:
        return p - lr * g / (ms + epsilon) + lamb * r * (p0 - p)

    return jax.tree.map(step, params, grads, params0, stats.rms, stats.decay)


def collect_gradient_statistics(
    segment_grad: SegmentGrad,
    params: Any,
    windows: Iterable[Any],
    carry: Any,
    *,
    lamb: float,
    style: str = "yang",
    max_batches: int | None = None,
    on_batch: Callable[[], Any] | None = None,
) -> GradientStatistics:
    """Sums squared gradients over training windows (no parameter updates, state carried).

    Args:
      segment_grad: pure ``(params, carry, window) -> ((nll_sum, count, carry), grads)``.
      params: the trained parameters.
      windows: training windows, in stream order.
      carry: initial recurrent state.
      lamb, style: see :func:`gradient_statistics`.
      max_batches: stop after this many windows (``None``: all).
      on_batch: called after every window (progress bars, interruption checks).
    """
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")

    sum_squares = jax.tree.map(jnp.zeros_like, params)
    num_batches = 0
    for window in windows:
        sum_squares, carry = _statistics_step(segment_grad, params, sum_squares, carry, window)
        num_batches += 1
        if on_batch is not None:
            on_batch()
        if max_batches is not None and num_batches >= max_batches:
            break
    if num_batches == 0:
        raise ValueError("windows must hold at least one training window")
    return gradient_statistics(sum_squares, num_batches, lamb=lamb, style=style)


def dynamic_evaluate(
    segment_grad: SegmentGrad,
    params: Any,
    windows: Iterable[Any],
    carry: Any,
    stats: GradientStatistics,
    *,
    lr: float,
    lamb: float,
    epsilon: float,
    on_batch: Callable[[], Any] | None = None,
) -> tuple[float, Any]:
    """Scores each window with the current parameters, then adapts them on it.

    Args:
      segment_grad: as for :func:`collect_gradient_statistics`; its loss is the window's mean
        NLL (``nll_sum / count``), as in Krause's code.
      params: θ₀, the parameters to start from (left unchanged).
      windows: evaluation segments in stream order (5 tokens long in the papers).
      carry: initial recurrent state.
      stats: from :func:`collect_gradient_statistics`.
      lr, lamb, epsilon: η, λ, ε of :func:`dynamic_eval_update`.
      on_batch: called after every window.

    Returns:
      Mean NLL per token over the stream (each token scored before the model saw it) and the
      adapted parameters.
    """
    hyper = {"lr": lr, "lamb": lamb, "epsilon": epsilon}
    params0, params = params, jax.tree.map(jnp.copy, params)
    total, tokens = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
    for window in windows:
        params, carry, nll_sum, count = _dynamic_eval_step(
            segment_grad, params, params0, stats, hyper, carry, window
        )
        total, tokens = total + nll_sum, tokens + count
        if on_batch is not None:
            on_batch()
    if int(tokens) == 0:
        raise ValueError("windows must hold at least one evaluation token")
    return float(total) / int(tokens), params


# Module-level jitted steps keyed on ``segment_grad`` (static: pass the same function object to
# reuse the compilation across calls, e.g. for the validation and the test split). Arrays are
# arguments, never closed over, so that they are not baked into the compiled program.
@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _statistics_step(
    segment_grad: SegmentGrad, params: Any, sum_squares: Any, carry: Any, window: Any
) -> tuple[Any, Any]:
    (_, _, carry), grads = segment_grad(params, carry, window)
    return accumulate_squared_gradients(sum_squares, grads), carry


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _dynamic_eval_step(
    segment_grad: SegmentGrad,
    params: Any,
    params0: Any,
    stats: GradientStatistics,
    hyper: dict[str, float],
    carry: Any,
    window: Any,
) -> tuple[Any, Any, jax.Array, jax.Array]:
    (nll_sum, count, carry), grads = segment_grad(params, carry, window)
    params = dynamic_eval_update(params, grads, params0, stats, **hyper)
    return params, carry, nll_sum, count
