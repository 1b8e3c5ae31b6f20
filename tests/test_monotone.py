import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn
from tests.jaxprs import equations


def np_plif(x, raw_slopes, bound):
    """PLIF straight from its definition (Ganea et al.; ``bn.plif``'s docstring), float64, one element at a time."""
    slopes = np.logaddexp(0.0, np.asarray(raw_slopes, np.float64))
    num_knots = len(slopes)
    delta = 2.0 * bound / num_knots
    out = []
    for value in np.asarray(x, np.float64).ravel():
        if value < -bound:
            out.append(-bound + slopes[0] * (value + bound))
            continue
        i = min(int((value + bound) // delta), num_knots - 1)
        out.append(-bound + delta * slopes[:i].sum() + slopes[i] * (value - (-bound + i * delta)))
    return np.array(out).reshape(np.shape(x))


def naive_plif(x, raw_slopes, bound):
    """Autodiff PLIF (exclusive cumsum + two gathers), the obvious implementation."""
    slopes = jax.nn.softplus(raw_slopes)
    num_knots = raw_slopes.shape[0]
    delta = 2.0 * bound / num_knots
    intercepts = -bound + delta * (jnp.cumsum(slopes) - slopes)
    index = jnp.clip(jnp.floor((x + bound) / delta), 0, num_knots - 1).astype(jnp.int32)
    return intercepts[index] + slopes[index] * (x - (index.astype(x.dtype) * delta - bound))


@pytest.mark.parametrize("num_knots, bound", [(2, 20.0), (7, 3.0), (1000, 20.0)])
def test_plif_matches_definition(num_knots, bound):
    kx, ks = jax.random.split(jax.random.key(0))
    x = 1.5 * bound * jax.random.normal(kx, (5, 40))  # a good share lands outside [-T, T]
    raw = bn.plif_init(ks, num_knots, noise=1.0)
    got = jax.jit(bn.plif, static_argnames="bound")(x, raw, bound=bound)
    np.testing.assert_allclose(got, np_plif(x, raw, bound), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_knots", [2, 10, 100_000])
def test_plif_identity_at_unit_slopes(num_knots):
    x = jnp.array([-1e4, -25.0, -20.0, -3.3, 0.0, 1e-3, 7.25, 19.999, 20.0, 31.0, 1e4])
    got = jax.jit(bn.plif)(x, bn.plif_init(jax.random.key(0), num_knots))
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=2e-4)


def test_plif_is_continuous_and_strictly_increasing():
    raw = bn.plif_init(jax.random.key(1), 50, noise=2.0)
    x = jnp.linspace(-30.0, 30.0, 20_001)
    f = jax.jit(bn.plif)(x, raw)
    assert bool(jnp.all(jnp.diff(f) > 0))
    knots = -20.0 + 0.8 * jnp.arange(51.0)  # delta = 40 / 50
    left, right = bn.plif(knots - 1e-4, raw), bn.plif(knots + 1e-4, raw)
    assert float(jnp.max(jnp.abs(right - left))) < 1e-2


def test_plif_gradients_match_finite_differences_float64():
    with jax.enable_x64(True):
        kx, ks = jax.random.split(jax.random.key(2))
        raw = bn.plif_init(ks, 9, noise=1.0).astype(jnp.float64)
        x = jnp.array([-31.0, -19.1, -7.9, -0.55, 0.3, 4.2, 12.7, 19.9, 26.0, 60.0])
        weights = jax.random.normal(kx, x.shape, jnp.float64)

        def loss(x, raw):
            return jnp.sum(weights * bn.plif(x, raw))

        grad_x, grad_raw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, raw)
        eps = 1e-6
        for i in range(raw.shape[0]):
            step = jnp.zeros_like(raw).at[i].set(eps)
            numeric = (loss(x, raw + step) - loss(x, raw - step)) / (2 * eps)
            np.testing.assert_allclose(grad_raw[i], numeric, rtol=1e-6, atol=1e-8)
        for i in range(x.shape[0]):
            step = jnp.zeros_like(x).at[i].set(eps)
            numeric = (loss(x + step, raw) - loss(x - step, raw)) / (2 * eps)
            np.testing.assert_allclose(grad_x[i], numeric, rtol=1e-6, atol=1e-8)


def test_plif_custom_vjp_matches_autodiff_of_naive_version():
    kx, ks, kg = jax.random.split(jax.random.key(3), 3)
    x = 10.0 * jax.random.normal(kx, (64, 300))
    raw = bn.plif_init(ks, 1000, noise=1.0)
    cotangent = jax.random.normal(kg, x.shape)
    # The forward pass inside jit too: one compile each, not op-by-op dispatch.
    ours = jax.jit(lambda x, r, c: jax.vjp(bn.plif, x, r)[1](c))(x, raw, cotangent)
    naive = jax.jit(lambda x, r, c: jax.vjp(lambda x, r: naive_plif(x, r, 20.0), x, r)[1](c))(
        x, raw, cotangent
    )
    chex.assert_trees_all_close(ours, naive, rtol=1e-4, atol=1e-4)


def test_plif_million_knots_and_extreme_inputs():
    raw = bn.plif_init(jax.random.key(4), 1_000_000, noise=1.0)
    x = jnp.concatenate(
        [jnp.array([-1e4, 1e4, -20.0, 20.0]), jax.random.normal(jax.random.key(5), (996,))]
    )
    value, grads = jax.jit(jax.value_and_grad(lambda x, r: jnp.sum(bn.plif(x, r)), argnums=(0, 1)))(
        x, raw
    )
    assert bool(jnp.isfinite(value))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert grads[1].shape == (1_000_000,)


def test_plif_backward_is_deterministic():
    x = 5.0 * jax.random.normal(jax.random.key(6), (128, 512))
    raw = bn.plif_init(jax.random.key(7), 100, noise=1.0)
    grad = jax.jit(jax.grad(lambda r: jnp.sum(jnp.sin(bn.plif(x, r)))))
    np.testing.assert_array_equal(grad(raw), grad(raw))


def test_plif_backward_scatters_only_real_values():
    # A GPU has no complex atomic add: there a complex scatter-add is a compare-and-swap loop
    # that collapses when many logits share a segment (PLIF's study step was ~1,000x softmax's
    # on an H200 when its histogram was one complex64 scatter-add).
    x = jax.random.normal(jax.random.key(11), (4, 8))
    raw = bn.plif_init(jax.random.key(12), 16)
    jaxpr = jax.make_jaxpr(jax.grad(lambda r: jnp.sum(bn.plif(x, r) ** 2)))(raw)
    scatters = [e for e in equations(jaxpr.jaxpr) if e.primitive.name.startswith("scatter")]
    assert scatters, "the slopes' gradient is a histogram: a scatter-add"
    for eqn in scatters:
        assert not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.complexfloating), eqn


def test_plif_vmaps_over_inputs_and_slopes():
    x = jax.random.normal(jax.random.key(8), (3, 20))
    raws = jax.vmap(lambda k: bn.plif_init(k, 16, noise=1.0))(
        jax.random.split(jax.random.key(9), 3)
    )
    batched = jax.jit(jax.vmap(bn.plif))(x, raws)

    @jax.jit  # one compile, not op-by-op dispatch
    def looped_and_grads(x, raws):
        looped = jnp.stack([bn.plif(x[i], raws[i]) for i in range(3)])
        grads = jax.vmap(jax.grad(lambda x, r: jnp.sum(bn.plif(x, r) ** 2), argnums=1))(x, raws)
        squared = jax.grad(lambda x, r: jnp.sum(bn.plif(x, r) ** 2), argnums=1)
        looped_grads = jnp.stack([squared(x[i], raws[i]) for i in range(3)])
        return looped, grads, looped_grads

    looped, grads, looped_grads = looped_and_grads(x, raws)
    chex.assert_trees_all_close(batched, looped, atol=1e-6)
    chex.assert_trees_all_close(grads, looped_grads, atol=1e-5)


def test_plif_bfloat16_inputs_compute_in_float32():
    x = jnp.linspace(-25.0, 25.0, 64).astype(jnp.bfloat16)
    raw = bn.plif_init(jax.random.key(10), 100, noise=1.0)
    got = bn.plif(x, raw)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_plif(x.astype(jnp.float32), raw, 20.0), rtol=1e-5, atol=1e-4)
    # The slopes' gradient too: its histograms sum in float32, not in the inputs' bfloat16.
    grad = jax.jit(jax.grad(lambda r, x: jnp.sum(bn.plif(x, r) ** 2)))
    got, want = grad(raw, x), grad(raw, x.astype(jnp.float32))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: bn.plif_init(jax.random.key(0), 0), "num_knots must be >= 2"),
        # One knot is affine (nn.PLIF refuses it with the same reason).
        (lambda: bn.plif_init(jax.random.key(0), 1), r"num_knots must be >= 2 \(one knot makes"),
        (
            lambda: bn.plif(jnp.zeros(3), jnp.zeros((1,))),
            r"raw_slopes must have shape \[num_knots\] with num_knots >= 2 \(one knot makes",
        ),
        (lambda: bn.plif(jnp.zeros(3), jnp.zeros(4), bound=0.0), "bound must be finite and > 0"),
        (lambda: bn.plif(jnp.zeros(3), jnp.zeros(4), bound=math.inf), "bound must be finite"),
        (lambda: bn.plif(jnp.zeros(3), jnp.zeros(4), bound=math.nan), "bound must be finite"),
        (lambda: bn.plif_init(jax.random.key(0), 4, noise=math.nan), "noise must be finite"),
        (lambda: bn.plif_init(jax.random.key(0), 4, noise=-1.0), "noise must be finite and >= 0"),
        (
            lambda: bn.plif(jnp.zeros(3), jnp.zeros((2, 4))),
            r"raw_slopes must have shape \[num_knots\]",
        ),
        (
            lambda: bn.plif(jnp.zeros(3), jnp.zeros((0,))),
            r"raw_slopes must have shape \[num_knots\]",
        ),
        (lambda: bn.plif(jnp.arange(3), jnp.zeros(4)), "x must have a floating dtype"),
        (lambda: bn.monotone_mlp_init(jax.random.key(0), 0), "num_hidden must be >= 1"),
        (lambda: bn.monotone_mlp(jnp.zeros(3), {"bias": jnp.zeros(())}), "params is missing"),
    ],
)
def test_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def np_monotone_mlp(x, params):
    softplus = lambda a: np.logaddexp(0.0, np.asarray(a, np.float64))  # noqa: E731
    x = np.asarray(x, np.float64)[..., None]
    hidden = 1.0 / (
        1.0
        + np.exp(
            -(
                x * softplus(params["raw_input_weights"])
                + np.asarray(params["hidden_biases"], np.float64)
            )
        )
    )
    out = hidden @ softplus(params["raw_output_weights"])
    return out + softplus(params["raw_linear"]) * x[..., 0] + float(params["bias"])


def _random_mlp_params(key, num_hidden):
    params = bn.monotone_mlp_init(key, num_hidden)
    noise = jax.random.normal(jax.random.key(11), (num_hidden,))
    return {
        **params,
        "raw_input_weights": params["raw_input_weights"] + noise,
        "bias": jnp.asarray(0.3),
    }


def test_monotone_mlp_matches_reference():
    params = _random_mlp_params(jax.random.key(12), 16)
    x = 4.0 * jax.random.normal(jax.random.key(13), (6, 9))
    np.testing.assert_allclose(
        jax.jit(bn.monotone_mlp)(x, params), np_monotone_mlp(x, params), rtol=1e-5, atol=1e-5
    )


def test_monotone_mlp_strictly_increasing_with_unbounded_image():
    params = _random_mlp_params(jax.random.key(14), 32)
    x = jnp.linspace(-50.0, 50.0, 10_001)
    f = jax.jit(bn.monotone_mlp)(x, params)
    assert bool(jnp.all(jnp.diff(f) > 0))
    slope = jax.nn.softplus(params["raw_linear"])

    @jax.jit  # one compile, not op-by-op dispatch
    def derivatives_and_ends(x, params):
        derivative = jax.vmap(jax.grad(bn.monotone_mlp), in_axes=(0, None))(x, params)
        ends = bn.monotone_mlp(jnp.array([-1e4, 1e4]), params)
        grads = jax.grad(lambda p: jnp.sum(bn.monotone_mlp(jnp.array([-1e4, 0.0, 1e4]), p)))(params)
        return derivative, ends, grads

    derivative, ends, grads = derivatives_and_ends(x, params)
    assert bool(jnp.all(derivative >= slope * (1 - 1e-6)))
    # Unbounded: the image keeps growing linearly far outside any sigmoid's bend.
    assert float(ends[0]) < -0.9e4 * float(slope) and float(ends[1]) > 0.9e4 * float(slope)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("num_bins", [7, 1000, 2**23])
def test_privatized_histogram_sums_like_a_plain_one(num_bins):
    """The accelerators' privatized scatter (R private copies, then a sum) gives the sums of
    np.bincount, also when most updates share a few bins and when one copy is all that fits."""
    from bottleneck.monotone import _privatized_histogram, _scatter_histogram

    n = 50_001
    crowded = jax.random.randint(jax.random.key(0), (n,), 0, 3)  # most updates in 3 bins
    spread = jax.random.randint(jax.random.key(1), (n,), 0, num_bins)
    index = jnp.where(jnp.arange(n) % 2 == 0, crowded, spread)
    values = jax.random.normal(jax.random.key(2), (n,))
    expected = np.bincount(np.asarray(index), np.asarray(values, np.float64), minlength=num_bins)
    for histogram in (_privatized_histogram, _scatter_histogram):
        got = jax.jit(histogram, static_argnums=2)(index, values, num_bins)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-3)
