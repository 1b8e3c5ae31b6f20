"""Log-space normalizers: softmax and Kanai et al.'s alternatives to it.

Every normalizer here has the form (Kanai et al. 2018, eq. 9)

    f(z)_i = g(z_i) / sum_m g(z_m)

for a positive, monotonically increasing pointwise ``g``, and is computed in log space as

    log f(z)_i = log g(z_i) - logsumexp_m log g(z_m).

Only ``log g`` differs between them (the "log scores" below). Softmax has ``log g(z) = z``,
which is linear, so its log-outputs stay in a (d+1)-dimensional space (Kanai, Theorem 2);
the others have a nonlinear ``log g`` and escape that bound.

All functions accept any leading shape ``[..., vocab]`` (vocabulary on ``axis``), reduce in
at least float32 (bfloat16/float16 inputs are promoted, float64 stays float64) and return
log-probabilities in that dtype. Callers jit. An ``axis`` outside the array or an empty
vocabulary (no distribution to normalize over) is a ``ValueError``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from bottleneck._checks import as_compute, require_float


def vocab_axis(name: str, x: jax.Array, axis: int) -> int:
    """``axis`` of ``x`` as a non-negative index; ``ValueError`` if out of range or empty.

    Shared by every function that takes the vocabulary on ``axis`` (normalizers, losses,
    mixtures): an empty vocabulary has no distribution, and would otherwise surface as an
    obscure reduction error (``max`` of an empty axis) or an empty result.
    """
    shape = jnp.shape(x)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(
            f"axis {axis} is out of range for {name} with shape {shape} (vocabulary axis)"
        )
    axis %= len(shape)
    if shape[axis] == 0:
        raise ValueError(
            f"{name} must have a non-empty vocabulary axis (axis {axis}), got shape {shape}"
        )
    return axis


def log_normalize(log_scores: jax.Array, axis: int = -1) -> jax.Array:
    r"""Normalizes log scores into log-probabilities: ``s - logsumexp(s)`` along ``axis``.

    .. math:: \log p_i = s_i - \log \sum_m \exp s_m

    The row maximum is subtracted before exponentiating, so scores of any magnitude
    (``|s|`` up to float max) give finite results.

    Args:
      log_scores: ``[..., vocab]`` floating array of unnormalised log scores ``log g(z)``.
      axis: the vocabulary axis.

    Returns:
      ``[..., vocab]`` log-probabilities whose exponentials sum to one along ``axis``.

    Raises:
      ValueError: ``axis`` out of range, or an empty vocabulary axis.
    """
    require_float("log_scores", log_scores)
    axis = vocab_axis("log_scores", log_scores, axis)
    s = as_compute(log_scores)
    # The maximum is only a shift for stability; its gradient contribution cancels exactly.
    row_max = jax.lax.stop_gradient(jnp.max(s, axis=axis, keepdims=True))
    shifted = s - row_max
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


@jax.custom_jvp
def _log_sigmoid(z: jax.Array) -> jax.Array:
    """``log sigma(z) = min(z, 0) - log1p(exp(-|z|))``, exact for any finite ``z``.

    Same values as ``jax.nn.log_sigmoid`` but about 4x faster on XLA:CPU, which lowers the
    latter through ``logaddexp`` and its infinity handling (benchmarks/normalizers.py). The
    derivative ``sigma(-z)`` is given explicitly: autodiff of ``min`` and ``abs`` gets it wrong
    at ``z = 0``.
    """
    return jnp.minimum(z, 0) - jnp.log1p(jnp.exp(-jnp.abs(z)))


@_log_sigmoid.defjvp
def _log_sigmoid_jvp(primals, tangents):
    (z,), (dz,) = primals, tangents
    return _log_sigmoid(z), jax.nn.sigmoid(-z) * dz


def softmax_log_scores(z: jax.Array) -> jax.Array:
    """``log g(z) = z`` for softmax (elementwise, any shape)."""
    require_float("z", z)
    return as_compute(z)


def sigsoftmax_log_scores(z: jax.Array) -> jax.Array:
    r"""``log g(z) = log(exp(z) sigma(z)) = z + log sigma(z)`` for sigsoftmax (Kanai eq. 11-12).

    Written as ``z + log_sigmoid(z)`` rather than ``2z - softplus(z)``: the two are equal, but the
    latter cancels catastrophically for large positive ``z`` (``2e4 - 1e4`` keeps only the
    float32 ulp of ``2e4``), while ``log_sigmoid(z)`` is tiny there.
    """
    require_float("z", z)
    z = as_compute(z)
    return z + _log_sigmoid(z)


def sigmoid_log_scores(z: jax.Array) -> jax.Array:
    r"""``log g(z) = log sigma(z)`` for Kanai's sigmoid-based normalizer (eq. 35)."""
    require_float("z", z)
    return _log_sigmoid(as_compute(z))


def relu_log_scores(z: jax.Array, eps: float = 1e-8) -> jax.Array:
    r"""``log g(z) = log(relu(z) + eps)`` for Kanai's ReLU-based normalizer (eq. 34)."""
    require_float("z", z)
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(
            f"eps must be > 0 and finite so that every log-probability is finite, got {eps}"
        )
    z = as_compute(z)
    return jnp.log(jax.nn.relu(z) + eps)


def log_softmax(z: jax.Array, axis: int = -1) -> jax.Array:
    r"""Log-softmax, :math:`\log \mathrm{softmax}(z)_i = z_i - \log \sum_m \exp z_m` (Kanai eq. 5).

    Args:
      z: ``[..., vocab]`` logits.
      axis: the vocabulary axis.

    Returns:
      ``[..., vocab]`` log-probabilities (float32 or wider).

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> bn.log_softmax(jnp.array([0.0, 0.0])).tolist()  # doctest: +ELLIPSIS
      [-0.693..., -0.693...]
    """
    return log_normalize(softmax_log_scores(z), axis=axis)


def log_sigsoftmax(z: jax.Array, axis: int = -1) -> jax.Array:
    r"""Log-sigsoftmax (Kanai et al. 2018, Definition 1, eq. 11).

    .. math::
       f(z)_i = \frac{\exp(z_i)\,\sigma(z_i)}{\sum_m \exp(z_m)\,\sigma(z_m)}, \qquad
       \log f(z) = 2z - \mathrm{softplus}(z) - c'(z)\mathbf{1} \quad \text{(eq. 12)}

    ``log f`` is nonlinear in ``z``, so its outputs are not confined to a (d+1)-dimensional
    space (Theorem 3); its gradient has no division (Theorem 5):
    ``d log f_i / d z_j = (1[i=j] - f_j)(2 - sigma(z_j))``.

    Args:
      z: ``[..., vocab]`` logits.
      axis: the vocabulary axis.

    Returns:
      ``[..., vocab]`` log-probabilities (float32 or wider).
    """
    return log_normalize(sigsoftmax_log_scores(z), axis=axis)


def log_sigmoid_normalizer(z: jax.Array, axis: int = -1) -> jax.Array:
    r"""Log of Kanai's sigmoid-based normalizer, :math:`\sigma(z_i) / \sum_m \sigma(z_m)` (eq. 35).

    Args:
      z: ``[..., vocab]`` logits.
      axis: the vocabulary axis.

    Returns:
      ``[..., vocab]`` log-probabilities (float32 or wider).
    """
    return log_normalize(sigmoid_log_scores(z), axis=axis)


def log_relu_normalizer(z: jax.Array, axis: int = -1, eps: float = 1e-8) -> jax.Array:
    r"""Log of Kanai's ReLU-based normalizer, :math:`(\mathrm{relu}(z_i)+\epsilon) / \sum_m (\mathrm{relu}(z_m)+\epsilon)`.

    Kanai et al. eq. 34 with ``eps = 1e-8`` as in their experiments; ``eps`` sits inside the
    sum so the outputs sum to one exactly. The gradient of ``log(relu(z) + eps)`` is
    ``1 / (z + eps)`` for ``z > 0``: finite, but as large as ``1/eps`` near zero, which is the
    numerical instability Kanai et al. (Appendix B.1) warn about.

    Args:
      z: ``[..., vocab]`` logits.
      axis: the vocabulary axis.
      eps: positive, finite floor added to every score (``inf`` would make every score
        infinite and every log-probability NaN, so it is refused like ``eps <= 0``).

    Returns:
      ``[..., vocab]`` log-probabilities (float32 or wider).
    """
    return log_normalize(relu_log_scores(z, eps=eps), axis=axis)
