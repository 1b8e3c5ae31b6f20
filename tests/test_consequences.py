"""bn.unargmaxable_tokens, bn.estimate_hidden_size and the gradient-bottleneck ratios against
plain NumPy / SciPy references and the papers' stated properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.spatial import ConvexHull

import bottleneck as bn
from bottleneck import nn

# ---- unargmaxable tokens ----------------------------------------------------------------------


def sphere(rng, m, d):
    x = rng.normal(size=(m, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("filter_steps", [20, 0])
def test_tokens_strictly_inside_the_hull_are_found_and_hull_tokens_are_not(filter_steps):
    rng = np.random.default_rng(0)
    hull = sphere(rng, 30, 3)  # every point of a sphere is a vertex of the hull
    weights = rng.dirichlet(np.ones(30), size=6)
    inside = 0.9 * weights @ hull  # strictly inside
    W = np.concatenate([hull[:10], inside, hull[10:]])
    got = bn.unargmaxable_tokens(W, filter_steps=filter_steps)
    np.testing.assert_array_equal(got, np.arange(10, 16))


def test_agrees_with_the_convex_hull_and_with_random_search():
    rng = np.random.default_rng(1)
    W = rng.normal(size=(60, 2))  # in the plane many points are inside the hull
    got = bn.unargmaxable_tokens(W)
    vertices = ConvexHull(W).vertices
    np.testing.assert_array_equal(got, np.setdiff1d(np.arange(60), vertices))
    angles = np.linspace(0, 2 * np.pi, 20_000, endpoint=False)
    won = np.unique(np.argmax(np.c_[np.cos(angles), np.sin(angles)] @ W.T, axis=1))
    np.testing.assert_array_equal(won, np.sort(vertices))


def test_bounded_box_with_bias_agrees_with_a_dense_grid():
    rng = np.random.default_rng(2)
    W, b = rng.normal(size=(40, 2)), rng.normal(size=40)
    got = bn.unargmaxable_tokens(W, b, bound=0.5)
    axis = np.linspace(-0.5, 0.5, 401)
    grid = np.stack(np.meshgrid(axis, axis), -1).reshape(-1, 2)
    won = np.unique(np.argmax(grid @ W.T + b, axis=1))
    np.testing.assert_array_equal(got, np.setdiff1d(np.arange(40), won))
    assert len(got) > 0 and len(won) > 3  # the case is not trivial either way


def test_a_bias_rescues_an_interior_token_and_with_a_bound_demotes_a_vertex():
    line = np.array([[-1.0], [0.0], [1.0]])
    assert bn.unargmaxable_tokens(line).tolist() == [1]
    assert bn.unargmaxable_tokens(line, np.array([0.0, 1.0, 0.0])).tolist() == []
    square = np.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    low = np.array([0.0, 0.0, 0.0, -10.0])
    assert bn.unargmaxable_tokens(square, low).tolist() == []  # unbounded h outgrows any bias
    assert bn.unargmaxable_tokens(square, low, bound=1.0).tolist() == [3]
    assert bn.unargmaxable_tokens(square, low, bound=10.0).tolist() == []


def test_ties_and_degenerate_decoders():
    W = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    assert bn.unargmaxable_tokens(W).tolist() == [0, 1]  # duplicates never win strictly
    assert bn.unargmaxable_tokens(np.zeros((3, 2))).tolist() == [0, 1, 2]
    assert bn.unargmaxable_tokens(np.zeros((1, 2))).tolist() == []


def test_unargmaxable_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"W must have shape \[M, d\]"):
        bn.unargmaxable_tokens(np.ones(3))
    with pytest.raises(ValueError, match="W must be finite"):
        bn.unargmaxable_tokens(np.array([[np.nan, 1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="b must have shape"):
        bn.unargmaxable_tokens(np.ones((3, 2)), np.ones(2))
    with pytest.raises(ValueError, match="bound must be a finite number > 0"):
        bn.unargmaxable_tokens(np.ones((3, 2)), bound=0.0)


# ---- hidden size ------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_hidden_size_of_float32_softmax_heads(d, bias):
    k1, k2, k3 = jax.random.split(jax.random.key(d), 3)
    hidden = jax.random.normal(k1, (64, d))
    W = jax.random.normal(k2, (300, d))
    b = 3.0 * jax.random.normal(k3, (300,)) if bias else jnp.zeros(300)
    log_probs = jax.nn.log_softmax(hidden @ W.T + b)  # float32
    assert bn.estimate_hidden_size(log_probs) == d
    logits = np.asarray(hidden, np.float64) @ np.asarray(W, np.float64).T + np.asarray(b)
    log_probs64 = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert bn.estimate_hidden_size(log_probs64) == d
    # float32 round-off judged with float64's epsilon looks like signal: the dtype carries eps.
    assert bn.estimate_hidden_size(np.asarray(log_probs, np.float64)) > d


@pytest.mark.parametrize("dead", [0, 3])
def test_hidden_size_when_the_hidden_states_barely_vary_along_some_directions(dead):
    """Trained hidden states can vary 1e5 times less along some directions than along others:
    those directions are still d's, and float32 round-off is still not; directions along which
    they do not vary at all (``dead``) are not counted."""
    rng = np.random.default_rng(dead)
    d, N, M = 24, 512, 2000
    spread = np.logspace(-5, 0, d)  # per-direction std of the hidden states
    spread[10 : 10 + dead] = 0.0
    rotation = np.linalg.qr(rng.normal(size=(d, d)))[0]  # no axis is special
    hidden = rng.normal(size=(N, d)) * spread @ rotation
    W, b = rng.normal(size=(M, d)), 2.0 * rng.normal(size=M)
    log_probs = jax.nn.log_softmax(jnp.asarray(hidden @ W.T + b, jnp.float32))
    assert bn.estimate_hidden_size(log_probs) == d - dead
    # The case is one that a threshold scaled as Numerical Recipes' (55 times larger) undercounts.
    x = np.asarray(log_probs, np.float64)
    recipes = 0.5 * np.sqrt(N + M + 1) * np.linalg.norm(x, 2) * np.finfo(np.float32).eps
    assert bn.estimate_hidden_size(log_probs, tol=recipes) < d - dead


def test_hidden_size_of_a_full_rank_stack_and_an_explicit_tolerance():
    rng = np.random.default_rng(0)
    assert bn.estimate_hidden_size(rng.normal(size=(20, 50))) == 19
    assert bn.estimate_hidden_size(rng.normal(size=(50, 20))) == 19
    y = np.diag([10.0, 1.0, 1e-3]) @ sphere(rng, 3, 3)
    centred_rows = np.r_[y, -y]  # column means 0; rows are not centred but Y's spectrum is known
    assert bn.estimate_hidden_size(centred_rows, tol=1e-2) <= bn.estimate_hidden_size(centred_rows)


def test_hidden_size_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"log_probs must have shape \[N, M\] with N, M >= 2"):
        bn.estimate_hidden_size(np.zeros((1, 5)))
    with pytest.raises(ValueError, match=r"log_probs must have shape \[N, M\]"):
        bn.estimate_hidden_size(np.zeros(5))
    with pytest.raises(ValueError, match="log_probs must be finite"):
        bn.estimate_hidden_size(np.array([[0.0, -np.inf], [0.0, 1.0]]))


# ---- gradient bottleneck ----------------------------------------------------------------------


def reference_ratio(W, g):
    q, _ = np.linalg.qr(np.asarray(W, np.float64))
    g = np.asarray(g, np.float64)
    return np.linalg.norm(g @ q, axis=-1) / np.linalg.norm(g, axis=-1)


def test_gradient_ratio_matches_an_explicit_projector():
    k1, k2 = jax.random.split(jax.random.key(0))
    W = jax.random.normal(k1, (50, 6))
    g = jax.random.normal(k2, (4, 3, 50))
    got = jax.jit(bn.gradient_bottleneck_ratio)(W, g)
    assert got.shape == (4, 3)
    np.testing.assert_allclose(got, reference_ratio(W, g), rtol=1e-5)
    assert bool(jnp.all((got >= 0) & (got <= 1)))


def test_gradient_ratio_properties():
    rng = np.random.default_rng(0)
    square = rng.normal(size=(5, 8))  # M <= d, full rank: nothing lost
    np.testing.assert_allclose(
        bn.gradient_bottleneck_ratio(jnp.asarray(square), jnp.asarray(rng.normal(size=(7, 5)))),
        1.0, rtol=1e-5,
    )  # fmt: skip
    M, d = 400, 16
    W = jnp.asarray(rng.normal(size=(M, d)))
    r = bn.gradient_bottleneck_ratio(W, jnp.asarray(rng.normal(size=(2000, M)), jnp.float32))
    assert abs(float(jnp.mean(r**2)) - d / M) < 0.003  # E r^2 = d / M; sd of the mean ~ 5e-4
    assert abs(float(jnp.mean(r)) - np.sqrt(d / M)) < 0.01
    assert float(bn.gradient_bottleneck_ratio(W, jnp.zeros(M))) == 0.0
    low_rank = jnp.asarray(rng.normal(size=(30, 2)) @ rng.normal(size=(2, 6)))  # rank 2 of d = 6
    g = jnp.asarray(rng.normal(size=(5, 30)))
    np.testing.assert_allclose(
        bn.gradient_bottleneck_ratio(low_rank, g), reference_ratio(low_rank[:, :2], g), rtol=1e-4
    )


def test_jacobian_ratio_of_linear_and_nonlinear_heads():
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    W = jax.random.normal(k1, (40, 5))
    h = jax.random.normal(k2, (2, 3, 5))
    g = jax.random.normal(k3, (2, 3, 40))
    linear = bn.jacobian_gradient_ratio(lambda x: W @ x + 1.0, h, g)
    np.testing.assert_allclose(linear, bn.gradient_bottleneck_ratio(W, g), rtol=1e-5)
    nonlinear = jax.jit(lambda h, g: bn.jacobian_gradient_ratio(lambda x: jnp.tanh(W @ x), h, g))
    want = [
        reference_ratio(np.asarray(W) * (1 - np.tanh(np.asarray(W @ x)) ** 2)[:, None], gx)
        for x, gx in zip(h.reshape(-1, 5), g.reshape(-1, 40), strict=True)
    ]
    np.testing.assert_allclose(nonlinear(h, g).reshape(-1), want, rtol=1e-4)


def test_head_ratio_of_a_softmax_head_is_the_decoders():
    head = nn.OutputHead(6, 30, rngs=nnx.Rngs(0))
    head.bias.set_value(jax.random.normal(jax.random.key(3), head.bias.shape))
    h = jax.random.normal(jax.random.key(4), (5, 6))
    labels = jnp.arange(5)
    p = jax.nn.softmax(head.logits(h)[:, :30])
    want = bn.gradient_bottleneck_ratio(head.decoder[...][:30], p - jax.nn.one_hot(labels, 30))
    np.testing.assert_allclose(bn.head_gradient_ratio(head, h, labels), want, rtol=1e-5)


@pytest.mark.parametrize("name", ["softmax", "mos"])
def test_head_ratio_in_batches_of_positions_is_the_same_ratio(name):
    # 7 positions in batches of 3: two whole batches and a remainder.
    options = {"num_components": 2} if name == "mos" else {}
    head = nn.make_head(name, 5, 20, **options, rngs=nnx.Rngs(2))
    h = jax.random.normal(jax.random.key(7), (7, 5))
    labels = jax.random.randint(jax.random.key(8), (7,), 0, 20)
    whole = bn.head_gradient_ratio(head, h, labels)
    batched = jax.jit(lambda h, y: bn.head_gradient_ratio(head, h, y, batch_size=3))(h, labels)
    # The same float32 projection in another batch layout: a mixture's goes through a QR of its
    # [M, d] Jacobian (round-off ~1e-5 relative; its float64 reference test allows 1e-3).
    np.testing.assert_allclose(batched, whole, rtol=1e-4)


@pytest.mark.parametrize("name", ["sigsoftmax", "plif", "monotone_mlp", "relu"])
def test_head_ratio_of_a_pointwise_head_uses_its_whole_jacobian(name):
    # PLIF has a custom VJP (no forward mode): the reference Jacobian is reverse-mode, per position.
    head = nn.make_head(name, 5, 40, rngs=nnx.Rngs(1))
    h = 3.0 * jax.random.normal(jax.random.key(5), (2, 3, 5))
    labels = jax.random.randint(jax.random.key(6), (2, 3), 0, 40)
    got = jax.jit(lambda h, y: bn.head_gradient_ratio(head, h, y))(h, labels)
    assert got.shape == (2, 3) and np.all(np.isfinite(got))

    def scores(x):
        return head.log_scores(head.logits(x))[:40]

    # One compile for every position, rather than op-by-op dispatch.
    jacobian_and_p = jax.jit(lambda x: (jax.jacrev(scores)(x), jax.nn.softmax(scores(x))))
    want = []
    for x, y in zip(np.asarray(h).reshape(-1, 5), np.asarray(labels).reshape(-1), strict=True):
        J, p = (np.asarray(a, np.float64) for a in jacobian_and_p(jnp.asarray(x)))
        want.append(reference_ratio(J, p - np.eye(40)[y]))
    np.testing.assert_allclose(np.asarray(got).reshape(-1), want, rtol=1e-4)


@pytest.mark.parametrize("name", ["mos", "mixtape"])
def test_head_ratio_of_a_mixture_projects_p_minus_e_y_on_its_log_prob_jacobian(name):
    head = nn.make_head(name, 6, 30, num_components=3, rngs=nnx.Rngs(0))
    h = 2.0 * jax.random.normal(jax.random.key(4), (2, 2, 6))
    labels = jnp.array([[0, 7], [29, 3]])
    got = jax.jit(lambda h, y: bn.head_gradient_ratio(head, h, y))(h, labels)
    assert got.shape == (2, 2)
    # One compile for every position, rather than op-by-op dispatch.
    jacobian_and_log_p = jax.jit(lambda x: (jax.jacfwd(head)(x), head(x)))
    want = []
    for x, y in zip(np.asarray(h).reshape(-1, 6), np.asarray(labels).reshape(-1), strict=True):
        # One position at a time (no vmap), the projection in float64 on the host.
        J, log_p = (np.asarray(a, np.float64) for a in jacobian_and_log_p(jnp.asarray(x)))
        p = np.exp(log_p)
        want.append(reference_ratio(J, p - np.eye(30)[y]))
    np.testing.assert_allclose(np.asarray(got).reshape(-1), want, rtol=1e-3)
    assert np.all((np.asarray(got) > 0) & (np.asarray(got) < 1))


def test_gradient_ratio_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"W must have shape \[M, d\]"):
        bn.gradient_bottleneck_ratio(jnp.ones(3), jnp.ones(3))
    with pytest.raises(ValueError, match=r"g must have shape \[\.\.\., M\] with M = 3"):
        bn.gradient_bottleneck_ratio(jnp.ones((3, 2)), jnp.ones(4))
    with pytest.raises(ValueError, match="must share their batch shape"):
        bn.jacobian_gradient_ratio(jnp.tanh, jnp.ones((2, 3)), jnp.ones((3, 3)))
