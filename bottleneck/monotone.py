"""Learnable monotone pointwise maps applied to logits before the softmax (Ganea et al. 2019).

``softmax(f(z))`` with a strictly increasing ``f`` keeps the ranking of the logits (so the
arg-max is unchanged) while making ``log softmax(f(z))`` nonlinear in ``z``, which breaks the
rank-(d+1) bound of plain softmax. Two parameterisations from the paper:

* :func:`plif`: a piecewise-linear increasing function with up to 10^6 knots, evaluated in
  O(1) per element and differentiated by a custom VJP (LMS-PLIF).
* :func:`monotone_mlp`: a one-hidden-layer network with positive weights.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from bottleneck._checks import compute_dtype, require_float
from bottleneck._vma import reduce_like

# softplus^{-1}(1) = log(e - 1): raw slopes at this value make PLIF the identity map.
IDENTITY_RAW_SLOPE = math.log(math.expm1(1.0))


def _inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


# Why a PLIF needs two knots (nn.PLIF's, bn.plif's and bn.plif_init's message).
ONE_KNOT = (
    " (one knot makes the PLIF affine, f(z) = s z + c: a softmax with a learned temperature, "
    "not a nonlinear map)"
)


def _check_plif_args(x: jax.Array, raw_slopes: jax.Array, bound: float) -> None:
    require_float("x", x)
    require_float("raw_slopes", raw_slopes)
    if jnp.ndim(raw_slopes) != 1 or jnp.shape(raw_slopes)[0] < 2:
        raise ValueError(
            f"raw_slopes must have shape [num_knots] with num_knots >= 2{ONE_KNOT}, got "
            f"{jnp.shape(raw_slopes)}"
        )
    if not 0 < bound < math.inf:  # inf would make the knot spacing inf and every value NaN
        raise ValueError(f"bound must be finite and > 0, got {bound}")


def _plif_table(raw_slopes: jax.Array, bound: float, dtype: jnp.dtype) -> jax.Array:
    """The ``[K]`` complex table ``f(t_i) + 1j * s_i`` (value at each knot, slope after it).

    Intercept and slope are packed into one complex number so that evaluation is a single
    gather of one element per input (a gather of ``[K, 2]`` rows is ~4x slower on XLA:CPU).
    """
    slopes = jax.nn.softplus(raw_slopes.astype(dtype))
    delta = 2.0 * bound / slopes.shape[0]
    preceding = jnp.cumsum(slopes) - slopes  # exclusive prefix sum: sum_{j<i} s_j
    intercepts = -bound + delta * preceding
    return jax.lax.complex(intercepts, slopes)


def _segment(x: jax.Array, num_knots: int, bound: float) -> tuple[jax.Array, jax.Array]:
    """Segment index ``i`` of each element and its offset ``x - t_i`` from the segment's knot.

    Inputs below ``-T`` fall in segment 0 and inputs above ``T`` in segment ``K-1``, which gives
    the linear extension with slopes ``s_0`` and ``s_{K-1}``. The clip happens in floating point
    so that |x| far beyond the int32 range is safe.
    """
    delta = 2.0 * bound / num_knots
    position = jnp.floor((x + bound) / delta)
    index = jnp.clip(position, 0, num_knots - 1).astype(jnp.int32)
    knot = index.astype(x.dtype) * delta - bound
    return index, x - knot


# Copies of the histogram a GPU scatters into (at most this many floats in all): see
# segment_histogram.
PRIVATE_HISTOGRAM_FLOATS = 2**22
PRIVATE_HISTOGRAM_COPIES = 128


def segment_histogram(index: jax.Array, values: jax.Array, num_bins: int) -> jax.Array:
    """``sum(values[index == b])`` for each bin ``b``: ``[n]``, ``[n]`` -> ``[num_bins]``.

    On a CPU one scatter-add. On an accelerator the adds go into ``R`` private copies of the
    histogram, element ``i`` into copy ``i mod R``, which are then summed (a privatized
    histogram): the same sums in another order. A GPU's scatter-add is made of atomic adds,
    and when most elements fall into a few bins (PLIF's logits at initialisation: 10^6
    updates into ~120 of 10^4 segments) the atomics on one address serialize; ``R`` copies
    divide that contention by ``R``. ``R = min(128, 2^22 / num_bins)``, at least 1, keeps the
    copies within 16 MiB of float32.
    """
    return jax.lax.platform_dependent(
        index,
        values,
        cpu=functools.partial(_scatter_histogram, num_bins=num_bins),
        default=functools.partial(_privatized_histogram, num_bins=num_bins),
    )


def _scatter_histogram(index: jax.Array, values: jax.Array, num_bins: int) -> jax.Array:
    return jnp.zeros((num_bins,), values.dtype).at[index].add(values)


def _privatized_histogram(index: jax.Array, values: jax.Array, num_bins: int) -> jax.Array:
    copies = max(1, min(PRIVATE_HISTOGRAM_COPIES, PRIVATE_HISTOGRAM_FLOATS // num_bins))
    copy = jnp.arange(index.shape[0], dtype=jnp.int32) % copies
    private = jnp.zeros((copies, num_bins), values.dtype).at[copy, index].add(values)
    return jnp.sum(private, axis=0)


def _plif_and_slope(
    x: jax.Array, raw_slopes: jax.Array, bound: float
) -> tuple[jax.Array, jax.Array]:
    """``f(x)`` and ``f'(x)``, the slope of each element's segment, from one gather."""
    index, offset = _segment(x, raw_slopes.shape[0], bound)
    entry = jnp.take(_plif_table(raw_slopes, bound, x.dtype), index, mode="clip")
    return entry.real + entry.imag * offset, entry.imag


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _plif(x: jax.Array, raw_slopes: jax.Array, bound: float) -> jax.Array:
    return _plif_and_slope(x, raw_slopes, bound)[0]


def _plif_fwd(x, raw_slopes, bound):
    # f'(x) is kept for the backward rather than gathered again there: PLIF's loss took 0.85x
    # its time at the study's d = 32 batch on a 2-core AMD EPYC (1.00x at d = 400, where the
    # products dominate; docs/benchmarks.md), and the chunked loss's temporaries did not grow.
    value, slope = _plif_and_slope(x, raw_slopes, bound)
    return value, (x, raw_slopes, slope)


def _plif_bwd(bound, residuals, g):
    x, raw_slopes, slope = residuals
    num_knots = raw_slopes.shape[0]
    delta = 2.0 * bound / num_knots
    index, offset = _segment(x, num_knots, bound)
    grad_x = g * slope
    # df/ds_j = delta for every segment j below x's segment, (x - t_i) for x's own segment i.
    # So the slope gradient is delta * (gradient mass strictly above j) + the within-segment
    # part: two real histograms (mass, mass * offset) and one reverse cumulative sum. Two
    # real scatter-adds, not one complex one: a GPU has no atomic add as wide as a complex64,
    # and the compare-and-swap loop XLA emits instead collapses when most logits fall in a few
    # segments (with the complex scatter, the study's PLIF step took 2.3-3.4 s on an H200,
    # softmax's 3 ms); on XLA:CPU the two are as fast as the one and give the same sums.
    # (plif() casts x and the slopes to one dtype of at least float32, so g has it too.)
    index = index.ravel()
    mass = segment_histogram(index, g.ravel(), num_knots)
    mass_offset = segment_histogram(index, (g * offset).ravel(), num_knots)
    mass_above = jnp.concatenate([jax.lax.cumsum(mass, reverse=True)[1:], jnp.zeros((1,), g.dtype)])
    grad_slopes = delta * mass_above + mass_offset
    grad_raw = grad_slopes * jax.nn.sigmoid(raw_slopes)
    # Inside shard_map with the logits split, each shard saw its own logits: the slopes'
    # gradient is the sum of the shards' (a no-op elsewhere).
    return grad_x, reduce_like(grad_raw, raw_slopes)


_plif.defvjp(_plif_fwd, _plif_bwd)


def plif(x: jax.Array, raw_slopes: jax.Array, bound: float = 20.0) -> jax.Array:
    r"""Piecewise-linear increasing function (PLIF) of Ganea et al. 2019, elementwise.

    ``K = raw_slopes.shape[0]`` segments split ``[-T, T]`` (``T = bound``) uniformly:
    ``delta = 2T/K``, knots ``t_i = -T + i delta``, slopes ``s = softplus(raw_slopes) > 0``.

    .. math::
       f(x) = -T + \delta \sum_{j<i} s_j + s_i (x - t_i), \qquad x \in [t_i, t_{i+1}),

    extended linearly with slope ``s_0`` below ``-T`` and ``s_{K-1}`` above ``T``, so ``f`` is
    continuous, strictly increasing and unbounded. With every ``s_i = 1`` it is the identity.

    Evaluation is O(1) per element: the segment index comes from arithmetic, then one gather
    from a precomputed ``[K]`` table. The backward pass is a custom VJP that histograms the
    incoming gradient over the segments and takes a reverse cumulative sum, so nothing larger
    than ``x`` is materialised and K = 10^6 knots cost O(K) extra memory.

    Args:
      x: floating array of any shape (typically logits ``[..., vocab]``).
      raw_slopes: ``[K]`` unconstrained slopes, ``K >= 2``; see :func:`plif_init`.
      bound: ``T > 0``, half-width of the knot range (20 in the paper).

    Returns:
      ``f(x)``, same shape as ``x``, dtype at least float32.

    Example:
      >>> import jax, jax.numpy as jnp, bottleneck as bn
      >>> raw = bn.plif_init(jax.random.key(0), 1000)  # identity at initialisation
      >>> bool(jnp.allclose(bn.plif(jnp.array([-30.0, 0.5, 7.0]), raw), jnp.array([-30.0, 0.5, 7.0]), atol=1e-4))
      True
    """
    _check_plif_args(x, raw_slopes, bound)
    x = jnp.asarray(x)
    dtype = compute_dtype(x, raw_slopes)
    return _plif(x.astype(dtype), raw_slopes.astype(dtype), float(bound))


def plif_init(key: jax.Array, num_knots: int, noise: float = 0.0) -> jax.Array:
    """Raw PLIF slopes ``softplus^{-1}(1) + noise * N(0, 1)``, shape ``[num_knots >= 2]``, float32.

    With ``noise = 0`` the PLIF is exactly the identity, so a PLIF head starts as plain softmax.
    The authors use K = 10^5 knots and optionally unit noise.
    """
    if num_knots < 2:
        raise ValueError(f"num_knots must be >= 2{ONE_KNOT}, got {num_knots}")
    if not 0 <= noise < math.inf:
        raise ValueError(f"noise must be finite and >= 0, got {noise}")
    raw = jnp.full((num_knots,), IDENTITY_RAW_SLOPE, jnp.float32)
    if noise:
        raw = raw + noise * jax.random.normal(key, (num_knots,), jnp.float32)
    return raw


def monotone_mlp_init(key: jax.Array, num_hidden: int, spread: float = 5.0) -> dict[str, jax.Array]:
    """Parameters for :func:`monotone_mlp` with ``num_hidden`` sigmoid units (float32).

    Starts near the identity: the positive linear coefficient is 1, the sigmoid units have
    unit input weights, output weights ``1/num_hidden`` (so they add at most 1 in total) and
    biases uniform in ``[-spread, spread]`` so their bends cover the typical logit range.
    """
    if num_hidden < 1:
        raise ValueError(f"num_hidden must be >= 1, got {num_hidden}")
    return {
        "raw_input_weights": jnp.full((num_hidden,), IDENTITY_RAW_SLOPE, jnp.float32),
        "hidden_biases": jax.random.uniform(key, (num_hidden,), jnp.float32, -spread, spread),
        "raw_output_weights": jnp.full(
            (num_hidden,), _inverse_softplus(1.0 / num_hidden), jnp.float32
        ),
        "raw_linear": jnp.asarray(IDENTITY_RAW_SLOPE, jnp.float32),
        "bias": jnp.zeros((), jnp.float32),
    }


_MONOTONE_MLP_KEYS = (
    "raw_input_weights",
    "hidden_biases",
    "raw_output_weights",
    "raw_linear",
    "bias",
)


def monotone_mlp(x: jax.Array, params: dict[str, jax.Array]) -> jax.Array:
    r"""Monotone one-hidden-layer network with positive weights (Ganea et al. 2019), elementwise.

    .. math::
       f(x) = \sum_{i=1}^{H} v_i\, \sigma(u_i x + b_i) + c\,x + b, \qquad
       v = \mathrm{softplus}(\cdot),\ u = \mathrm{softplus}(\cdot),\ c = \mathrm{softplus}(\cdot) > 0.

    The sum of sigmoids alone is the paper's universal approximator of monotone functions,
    but it is bounded (its image lies in ``(b, b + sum v)``), and the slides require an
    unbounded image so that ``softmax(f(z))`` can still put almost all mass on one outcome
    (sparse distributions). The linear term ``c x`` with ``c > 0`` makes the image all of R
    and the map strictly increasing: ``f'(x) >= c > 0``.

    Memory: the hidden layer materialises ``[..., H]`` per element of ``x`` (the slides'
    ``N x M x K`` tensor); heads evaluate it chunk by chunk.

    Args:
      x: floating array of any shape (typically logits ``[..., vocab]``).
      params: from :func:`monotone_mlp_init`: ``raw_input_weights``, ``hidden_biases``,
        ``raw_output_weights`` (each ``[H]``), ``raw_linear`` and ``bias`` (scalars).

    Returns:
      ``f(x)``, same shape as ``x``, dtype at least float32.
    """
    require_float("x", x)
    missing = [k for k in _MONOTONE_MLP_KEYS if k not in params]
    if missing:
        raise ValueError(f"params is missing {missing}; build it with monotone_mlp_init")
    hidden_shapes = {jnp.shape(params[k]) for k in _MONOTONE_MLP_KEYS[:3]}
    if len(hidden_shapes) != 1 or len(next(iter(hidden_shapes))) != 1:
        raise ValueError(
            f"params hidden weights must all have shape [num_hidden], got {hidden_shapes}"
        )
    dtype = compute_dtype(x)
    p = {k: jnp.asarray(params[k]).astype(dtype) for k in _MONOTONE_MLP_KEYS}
    x = jnp.asarray(x).astype(dtype)
    u = jax.nn.softplus(p["raw_input_weights"])
    v = jax.nn.softplus(p["raw_output_weights"])
    hidden = jax.nn.sigmoid(x[..., None] * u + p["hidden_biases"])
    return hidden @ v + jax.nn.softplus(p["raw_linear"]) * x + p["bias"]
