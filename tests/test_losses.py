import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn
from bottleneck.losses import chunked_cross_entropy, target_log_probs


def test_cross_entropy_matches_reference():
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(0), (3, 4, 10)))
    labels = jax.random.randint(jax.random.key(1), (3, 4), 0, 10)
    got = jax.jit(bn.cross_entropy)(log_probs, labels)
    lp = np.asarray(log_probs, np.float64)
    want = -np.mean(np.take_along_axis(lp, np.asarray(labels)[..., None], -1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cross_entropy_mask_ignores_positions():
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(2), (6, 5)))
    labels = jnp.array([0, 1, 2, 3, 4, 0])
    where = jnp.array([True, False, True, True, False, False])
    got = jax.jit(bn.cross_entropy)(log_probs, labels, where)
    want = bn.cross_entropy(log_probs[where], labels[where])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(bn.cross_entropy(log_probs, labels, jnp.zeros(6, bool))) == 0.0
    grad = jax.grad(lambda lp: bn.cross_entropy(lp, labels, where))(log_probs)
    assert bool(jnp.all(grad[~where] == 0))


def test_cross_entropy_vmaps():
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(3), (4, 7, 9)))
    labels = jax.random.randint(jax.random.key(4), (4, 7), 0, 9)
    per_row = jax.vmap(bn.cross_entropy)(log_probs, labels)
    np.testing.assert_allclose(jnp.mean(per_row), bn.cross_entropy(log_probs, labels), rtol=1e-6)


@pytest.mark.parametrize(
    "labels, where, message",
    [
        (jnp.zeros((3,), jnp.int32), None, r"labels must have shape \(2,\)"),
        (jnp.zeros((2,)), None, "labels must have an integer dtype"),
        (jnp.zeros((2,), jnp.int32), jnp.ones((3,), bool), r"where must have shape \(2,\)"),
    ],
)
def test_cross_entropy_bad_arguments(labels, where, message):
    with pytest.raises(ValueError, match=message):
        bn.cross_entropy(jnp.zeros((2, 5)), labels, where)


# Out-of-range labels: M itself, far beyond M, negative (which jnp indexing would wrap to the
# last class), and an int64 value that jnp.asarray would silently wrap to 3 without x64.
BAD_LABELS = [5, 10**6, -1, 2**32 + 3]
INT32_MAX = 2**31 - 1


def _labels_with(bad):
    """Concrete int64 labels (NumPy; jnp.asarray would narrow them to int32)."""
    return np.array([0, 3, bad, 1], np.int64)


@pytest.mark.parametrize("bad", BAD_LABELS, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_cross_entropy_out_of_range_labels_raise_when_concrete(bad, masked):
    """Concrete labels outside [0, M) are refused, at masked (padding) positions too."""
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(5), (4, 5)))
    where = np.array([True, True, not masked, True])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        bn.cross_entropy(log_probs, _labels_with(bad), where)


@pytest.mark.parametrize("bad", [5, 10**6, -1], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_cross_entropy_out_of_range_labels_nan_under_jit(bad, masked):
    """Traced labels cannot be read: a bad one makes the loss and its gradient NaN."""
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(5), (4, 5)))
    labels = jnp.array([0, 3, bad, 1])
    where = jnp.array([True, True, not masked, True])
    loss = jax.jit(bn.cross_entropy)(log_probs, labels, where)
    assert bool(jnp.isnan(loss)), loss
    logits = jax.random.normal(jax.random.key(5), (4, 5))
    grads = jax.jit(jax.grad(lambda z, y: bn.cross_entropy(bn.log_softmax(z), y, where)))(
        logits, labels
    )
    assert bool(jnp.all(jnp.isnan(grads[where])))  # every row that counts: no plausible update
    per_row = jax.vmap(bn.cross_entropy)(log_probs[:, None], labels[:, None])
    np.testing.assert_array_equal(np.isnan(per_row), [False, False, True, False])
    # Valid labels: the same loss as before, exactly.
    good = labels.at[2].set(2)
    want = -jnp.sum(jnp.where(where, log_probs[jnp.arange(4), good], 0.0)) / jnp.sum(where).astype(
        jnp.float32
    )
    np.testing.assert_allclose(jax.jit(bn.cross_entropy)(log_probs, good, where), want, rtol=1e-6)


@pytest.mark.parametrize("bad", BAD_LABELS, ids=str)
def test_target_log_probs_out_of_range_labels(bad):
    scores = jax.random.normal(jax.random.key(6), (4, 5))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        target_log_probs(scores, _labels_with(bad))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):  # padding columns
        target_log_probs(scores, np.array([0, 1, 2, 3]), vocab_size=3)
    if bad > INT32_MAX:
        return  # not representable as a traced int32 (no x64)
    got = jax.jit(target_log_probs)(scores, jnp.array([0, 3, bad, 1]))
    want = jnp.take_along_axis(bn.log_softmax(scores), jnp.array([[0], [3], [0], [1]]), -1)[:, 0]
    np.testing.assert_array_equal(np.isnan(got), [False, False, True, False])
    np.testing.assert_allclose(got[jnp.array([0, 1, 3])], want[jnp.array([0, 1, 3])], rtol=1e-6)
    grads = jax.jit(jax.grad(lambda s, y: jnp.sum(target_log_probs(s, y))))(
        scores, jnp.array([0, 3, bad, 1])
    )
    assert bool(jnp.all(jnp.isnan(grads[2])))


def _linear_softmax(params, h, labels):
    return target_log_probs(h @ params["w"], labels)


@pytest.mark.parametrize("bad", BAD_LABELS, ids=str)
@pytest.mark.parametrize("memory_budget", [2**30, 100], ids=["one_chunk", "many_chunks"])
def test_chunked_cross_entropy_out_of_range_labels(bad, memory_budget):
    """Checked by the mechanism itself (vocab_size), whatever token_log_probs does."""
    keys = jax.random.split(jax.random.key(7), 2)
    params = {"w": jax.random.normal(keys[0], (3, 5))}
    h = jax.random.normal(keys[1], (4, 3))
    where = jnp.array([True, True, False, True])  # the bad label sits at a masked position

    def loss(params, h, labels, clip=False):
        token_log_probs = _linear_softmax
        if clip:  # a token_log_probs that never yields NaN itself
            token_log_probs = lambda p, h, y: _linear_softmax(p, h, jnp.clip(y, 0, 4))  # noqa: E731
        return chunked_cross_entropy(
            token_log_probs, params, h, labels, where,
            vocab_size=5, elements_per_token=5, memory_budget=memory_budget,
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        loss(params, h, _labels_with(bad))
    good = jnp.array([0, 3, 2, 1])
    want = bn.cross_entropy(bn.log_softmax(h @ params["w"]), good, where)
    np.testing.assert_allclose(jax.jit(loss)(params, h, good), want, rtol=1e-6)
    if bad > INT32_MAX:
        return
    labels = jnp.array([0, 3, bad, 1])
    for clip in (False, True):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=3)(
            params, h, labels, clip
        )
        assert bool(jnp.isnan(value))
        assert bool(jnp.all(jnp.isnan(grads[0]["w"])))  # no plausible parameter update
        assert bool(jnp.all(jnp.isnan(grads[1][2])))  # the bad token's hidden state


@pytest.mark.parametrize("memory_budget", [2**30, 100], ids=["one_chunk", "many_chunks"])
def test_chunked_cross_entropy_prepare_runs_once_and_carries_the_gradients(memory_budget):
    """``prepare`` (here: the decoder's columns gathered in another order, twice each) is
    applied to the parameters once per call, and the loss and every gradient are those of the
    plain loss: the gradients reach the parameters back through ``prepare``."""
    keys = jax.random.split(jax.random.key(11), 3)
    params = {"w": jax.random.normal(keys[0], (3, 5)), "scale": jnp.float32(1.5)}
    h = jax.random.normal(keys[1], (9, 3))
    labels = jax.random.randint(keys[2], (9,), 0, 5)
    where = jnp.arange(9) % 4 != 1
    order = jnp.array([3, 0, 4, 1, 2])
    position = jnp.argsort(order)  # where each column sits in the prepared layout
    calls = []

    def prepare(params):
        calls.append(1)
        return {**params, "w": params["w"][:, order], "w_again": params["w"][:, order]}

    def prepared_log_probs(prepared, h, labels):
        w = (prepared["w"] + prepared["w_again"]) / 2  # each prepared copy gets half
        return target_log_probs(prepared["scale"] * h @ w, position[labels])

    def plain_log_probs(params, h, labels):
        return target_log_probs(params["scale"] * h @ params["w"], labels)

    def loss(params, h, prepare_fn, log_probs):
        return chunked_cross_entropy(
            log_probs, params, h, labels, where, vocab_size=5, elements_per_token=5,
            memory_budget=memory_budget, prepare=prepare_fn,
        )  # fmt: skip

    grad = jax.value_and_grad(loss, argnums=(0, 1))
    want, want_grads = grad(params, h, None, plain_log_probs)
    got, got_grads = grad(params, h, prepare, prepared_log_probs)
    assert len(calls) == 1
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss(params, h, prepare, prepared_log_probs), want, rtol=1e-6)


@pytest.mark.parametrize("axis", [0, 1, -2, 2])
def test_cross_entropy_vocabulary_on_any_axis(axis):
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(8), (3, 4, 6)))
    labels = jax.random.randint(jax.random.key(9), (3, 4), 0, 6)
    where = jax.random.bernoulli(jax.random.key(10), 0.7, (3, 4))
    moved = jnp.moveaxis(log_probs, -1, axis)
    want, want_grad = jax.value_and_grad(bn.cross_entropy)(log_probs, labels, where)
    got, got_grad = jax.jit(jax.value_and_grad(bn.cross_entropy), static_argnums=3)(
        moved, labels, where, axis
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, jnp.moveaxis(want_grad, -1, axis), rtol=1e-6)
    # Labels take log_probs' shape without the vocabulary axis.
    moved_labels_shape = list(moved.shape)
    del moved_labels_shape[axis]
    assert tuple(moved_labels_shape) == labels.shape
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 6\)"):
        bn.cross_entropy(moved, labels.at[0, 0].set(6), axis=axis)


def test_cross_entropy_vocabulary_axis_moves_the_labels_shape():
    log_probs = bn.log_softmax(jnp.zeros((5, 2, 3)), axis=0)
    np.testing.assert_allclose(
        bn.cross_entropy(log_probs, jnp.zeros((2, 3), int), axis=0), np.log(5), rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 3\)"):
        bn.cross_entropy(log_probs, jnp.zeros((5, 2), int), axis=0)
    with pytest.raises(ValueError, match="axis 3 is out of range for log_probs"):
        bn.cross_entropy(log_probs, jnp.zeros((5, 2), int), axis=3)
    with pytest.raises(ValueError, match="non-empty vocabulary axis"):
        bn.cross_entropy(jnp.zeros((2, 0)), jnp.zeros((2,), int))


@pytest.mark.parametrize("reverse_only", [False, True])
def test_log_partition_of_blocks_is_the_logsumexp_of_their_columns(reverse_only):
    """Blocks in any order normalize as one row; -inf columns count for nothing; the gradient
    (the hand-written VJP's too) is the softmax over all columns."""
    from bottleneck.losses import log_partition

    a = jax.random.normal(jax.random.key(0), (5, 7)) * 30.0
    b = jax.random.normal(jax.random.key(1), (5, 3)) * 30.0
    b = b.at[:, 1].set(-jnp.inf)
    both = jnp.concatenate([b, a], axis=-1)
    got = log_partition(a, b, jnp.zeros((5, 0)), reverse_only=reverse_only)
    np.testing.assert_allclose(got, jax.nn.logsumexp(both, axis=-1), rtol=1e-6)
    weights = jnp.arange(5.0)

    def total(a, b):
        return jnp.sum(weights * log_partition(a, b, reverse_only=reverse_only))

    grad_a, grad_b = jax.grad(total, argnums=(0, 1))(a, b)
    expected = weights[:, None] * jax.nn.softmax(both, axis=-1)
    # exp(s - log Z) of scores ~100 in magnitude carries ~|s| eps of relative round-off.
    np.testing.assert_allclose(
        jnp.concatenate([grad_b, grad_a], -1), expected, rtol=100 * 1.2e-7, atol=1e-6
    )
    assert not np.any(np.isnan(grad_b))
    with pytest.raises(ValueError, match="at least one vocabulary column"):
        log_partition(jnp.zeros((2, 0)))
