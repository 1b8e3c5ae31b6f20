"""Singular spectra and ranks of log-probability matrices and of Jacobians.

Yang et al. 2018 and Kanai et al. 2018 measure the softmax bottleneck as the rank of the
``[contexts, vocab]`` log-probability matrix; Orhan looks at the whole singular spectrum of a
layer's Jacobian, since near-zero singular values restrict a model as much as zero ones.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from bottleneck._checks import as_compute, require_float, require_ndim


def singular_values(a: jax.Array) -> jax.Array:
    """Singular values of ``a`` in descending order.

    Args:
      a: ``[..., m, n]`` floating matrix (or batch of matrices).

    Returns:
      ``[..., min(m, n)]`` non-negative singular values, largest first, dtype at least float32.
    """
    require_float("a", a)
    require_ndim("a", a, 2, "[..., m, n]")
    return jnp.linalg.svd(as_compute(a), compute_uv=False)


def _nan_unless_finite(a: jax.Array, count: jax.Array) -> jax.Array:
    """``count`` as float32, NaN for each matrix of ``a [..., m, n]`` that holds a NaN or inf.

    The SVD of such a matrix gives NaN singular values, which no comparison counts: without
    this a rank would read 0, a plausible number. A flag, not a raise, so it holds under jit.
    """
    finite = jnp.all(jnp.isfinite(a), axis=(-2, -1))
    return jnp.where(finite, count.astype(jnp.float32), jnp.nan)


def numerical_rank(a: jax.Array, tol: float | jax.Array | None = None) -> jax.Array:
    r"""Number of singular values above ``tol``.

    The default is the Numerical Recipes threshold used by Yang et al. and Kanai et al.:

    .. math:: \tau = \tfrac12 \sqrt{m + n + 1}\; \sigma_{\max}\; \epsilon_{\text{dtype}}

    Args:
      a: ``[..., m, n]`` floating matrix.
      tol: absolute threshold; ``None`` for the default above.

    Returns:
      ``[...]`` float32 rank(s): a whole number, or NaN for a matrix holding NaN or inf
      (log-probabilities of ``-inf`` included), whose singular values are undefined; under
      ``jit`` too. ``int(rank)`` of a NaN raises, so a script cannot print it as a count.
    """
    s = singular_values(a)
    if tol is None:
        m, n = jnp.shape(a)[-2:]
        eps = jnp.finfo(s.dtype).eps
        tol = 0.5 * (m + n + 1) ** 0.5 * s[..., :1] * eps
    else:
        tol = jnp.asarray(tol, s.dtype)[..., None]
    return _nan_unless_finite(a, jnp.sum(s > tol, axis=-1, dtype=jnp.int32))


def effective_rank(a: jax.Array, energy: float = 0.99) -> jax.Array:
    r"""Smallest ``k`` with :math:`\sum_{i \le k} \sigma_i^2 \ge \text{energy} \cdot \sum_i \sigma_i^2`.

    The number of directions that hold ``energy`` of the squared Frobenius norm: unlike the
    numerical rank, it ignores directions that exist but barely matter.

    Args:
      a: ``[..., m, n]`` floating matrix.
      energy: fraction in ``(0, 1]``.

    Returns:
      ``[...]`` float32 effective rank(s): a whole number (0 for an all-zero matrix), or NaN
      for a matrix holding NaN or inf, under ``jit`` too.
    """
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    power = jnp.square(singular_values(a))
    cumulative = jnp.cumsum(power, axis=-1)
    # A relative slack of a few ulps so that energy = 1 does not miss the last value to rounding.
    target = energy * cumulative[..., -1:] * (1 - 4 * jnp.finfo(power.dtype).eps)
    count = jnp.sum(cumulative < target, axis=-1, dtype=jnp.int32) + jnp.where(
        cumulative[..., -1] > 0, 1, 0
    ).astype(jnp.int32)
    return _nan_unless_finite(a, count)


def jacobian_singular_values(f: Callable[[jax.Array], jax.Array], xs: jax.Array) -> jax.Array:
    r"""Mean over inputs of the descending singular values of the Jacobian of ``f`` (Orhan).

    .. math:: \bar\sigma_i = \frac{1}{B} \sum_{b=1}^{B} \sigma_i\!\left(\frac{\partial f}{\partial x}(x_b)\right)

    Args:
      f: maps one input ``[n_in]`` to one output ``[n_out]``.
      xs: ``[B, n_in]`` inputs at which the Jacobian is evaluated (vmapped).

    Returns:
      ``[min(n_in, n_out)]`` mean singular values, largest first.
    """
    require_float("xs", xs)
    if jnp.ndim(xs) != 2:
        raise ValueError(f"xs must have shape [num_inputs, n_in], got {jnp.shape(xs)}")
    jacobians = jax.vmap(jax.jacfwd(f))(xs)
    if jacobians.ndim != 3:
        raise ValueError(
            f"f must map [n_in] to [n_out]; its Jacobians have shape {jacobians.shape[1:]}"
        )
    return jnp.mean(singular_values(jacobians), axis=0)
