"""AWD-LSTM: shapes, dropout semantics (locked, embedding, weight drop), AR/TAR, state carry, tying.

Compilation dominates on CPU, so the tests share two models and a few jitted entry points
(``nnx.jit`` caches on the model's graph): one compilation per entry point, not per test.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bottleneck as bn
from bottleneck import nn
from bottleneck.nn.awd_lstm import (
    AWDLSTM,
    LSTMState,
    embed,
    inverted_dropout_masks,
    locked_dropout,
    lstm,
)

V, E, H, T, B = 30, 6, 10, 7, 3
ALPHA, BETA = 2.0, 1.0
RATES = {"dropout": 0.4, "dropouth": 0.3, "dropouti": 0.4, "dropoute": 0.2, "wdrop": 0.5}


def build(head="softmax", **options):
    if head == "mos":
        options = {"nhidlast": 8, "num_components": 3, **options}
    return AWDLSTM(V, emsize=E, nhid=H, nlayers=2, head=head, rngs=nnx.Rngs(0), **options)


@pytest.fixture(scope="module")
def model():
    return build(**RATES)


@pytest.fixture(scope="module")
def mos_model():
    return build("mos", dropoutl=0.3, **RATES)


@nnx.jit
def objective(model, x, y, key=None, length=None):
    return model.objective(x, y, key=key, length=length, alpha=ALPHA, beta=BETA)


@nnx.jit
def log_probs(model, x, carry=None):
    return model(x, carry)


@nnx.jit
def rnn(model, x, masks=None):
    return model.rnn(x, masks=masks)


@nnx.jit
def dropout_masks(model, key):
    return model.dropout_masks(key, B)


def tokens(shape=(T, B), seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, V)


def naive_lstm(w_ih, w_hh, bias, inputs, state, length=None):
    """The LSTM written step by step, differentiated by plain autodiff through the scan."""

    def step(carry, xs):
        x, t = xs
        i, f, g, o = jnp.split(x @ w_ih.T + carry.h @ w_hh.T + bias, 4, axis=-1)
        c = jax.nn.sigmoid(f) * carry.c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        if length is not None:
            h, c = jnp.where(t < length, h, carry.h), jnp.where(t < length, c, carry.c)
        return LSTMState(h, c), h

    final, outputs = jax.lax.scan(step, state, (inputs, jnp.arange(inputs.shape[0])))
    return outputs, final


def lstm_problem(seed=0, steps=6, batch=2, features=3, hidden=4):
    keys = jax.random.split(jax.random.key(seed), 8)
    normal = lambda i, shape: jax.random.normal(keys[i], shape)  # noqa: E731
    args = (
        normal(0, (4 * hidden, features)),
        normal(1, (4 * hidden, hidden)),
        normal(2, (4 * hidden,)),
        normal(3, (steps, batch, features)),
        LSTMState(normal(4, (batch, hidden)), normal(5, (batch, hidden))),
    )
    # Cotangents on every output (all steps' h, final h and c), so every gradient path counts.
    weights = (normal(6, (steps, batch, hidden)), normal(7, (2, batch, hidden)))
    return args, weights


def weighted_sum(fn, weights, length):
    def loss(*args):
        outputs, final = fn(*args, length=length)
        return (
            jnp.sum(outputs * weights[0])
            + jnp.sum(final.h * weights[1][0])
            + jnp.sum(final.c * weights[1][1])
        )

    return loss


@pytest.mark.parametrize("length", [None, 4, 0, 6])
def test_lstm_values_and_all_gradients_equal_autodiff_through_a_naive_scan(length):
    args, weights = lstm_problem()
    argnums = tuple(range(5))  # w_ih, w_hh, bias, inputs, initial state (h and c)
    length = None if length is None else jnp.int32(length)  # traced under jit, as in training
    got = jax.jit(jax.value_and_grad(weighted_sum(lstm, weights, length), argnums))(*args)
    want = jax.value_and_grad(weighted_sum(naive_lstm, weights, length), argnums)(*args)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(
        jax.jit(lambda *a: lstm(*a, length=length))(*args),
        naive_lstm(*args, length=length),
        rtol=1e-5,
        atol=1e-6,
    )
    if length is not None and int(length) < 6:  # padding steps carry the state, take no gradient
        outputs, final = lstm(*args, length=length)
        np.testing.assert_array_equal(
            outputs[int(length) :], jnp.broadcast_to(final.h, (6 - int(length), 2, 4))
        )


def test_lstm_gradients_under_vmap_over_sequences_with_their_own_lengths():
    problems = [lstm_problem(seed) for seed in range(3)]
    args = jax.tree.map(lambda *xs: jnp.stack(xs), *[p[0] for p in problems])
    weights = jax.tree.map(lambda *xs: jnp.stack(xs), *[p[1] for p in problems])
    lengths = jnp.array([6, 2, 0], jnp.int32)

    def grads(fn):
        def one(args, weights, length):
            return jax.grad(weighted_sum(fn, weights, length), tuple(range(5)))(*args)

        return jax.jit(jax.vmap(one))(args, weights, lengths)

    chex.assert_trees_all_close(grads(lstm), grads(naive_lstm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["model", "mos_model"])
def test_shapes(name, request):
    model = request.getfixturevalue(name)
    lp, carry = log_probs(model, tokens())
    assert lp.shape == (T, B, V)
    np.testing.assert_allclose(jnp.sum(jnp.exp(lp), -1), 1.0, rtol=1e-5)
    last = 8 if name == "mos_model" else E
    assert [(s.h.shape, s.c.shape) for s in carry] == [((B, H), (B, H)), ((B, last), (B, last))]
    loss, aux = objective(model, tokens(), tokens(seed=2), jax.random.key(0))
    assert loss.shape == () and np.isfinite(loss)
    np.testing.assert_allclose(loss, aux.nll + aux.ar + aux.tar, rtol=1e-6)


def test_evaluation_is_deterministic_and_training_uses_dropout(model):
    x, y = tokens(), tokens(seed=2)
    eval_a, eval_b = objective(model, x, y), objective(model, x, y)
    chex.assert_trees_all_equal(eval_a, eval_b)
    train_a = objective(model, x, y, jax.random.key(0))[0]
    train_b = objective(model, x, y, jax.random.key(1))[0]
    assert train_a != train_b and train_a != eval_a[0]
    # Evaluation is __call__'s mode; masks of ones are no dropout at all.
    np.testing.assert_allclose(
        eval_a[1].nll, bn.cross_entropy(log_probs(model, x)[0], y), rtol=1e-5
    )
    masks = dropout_masks(model, jax.random.key(0))
    ones = jax.tree.map(jnp.ones_like, masks)
    chex.assert_trees_all_close(rnn(model, x, ones), rnn(model, x), rtol=1e-6)


def test_inverted_dropout_masks():
    big, off, small = inverted_dropout_masks(
        jax.random.key(0), [((400, 50), 0.3), ((7,), 0.0), ((1, 4, 9), 0.5)]
    )
    assert off is None and big.shape == (400, 50) and small.shape == (1, 4, 9)
    np.testing.assert_allclose(np.unique(big), [0.0, 1 / 0.7], rtol=1e-6)
    assert abs(float(jnp.mean(big == 0)) - 0.3) < 0.02  # p of dropping
    np.testing.assert_allclose(jnp.mean(big), 1.0, atol=0.03)  # E[mask] = 1
    with pytest.raises(ValueError, match="dropout rate must be in"):
        inverted_dropout_masks(jax.random.key(0), [((3,), 1.0)])


def test_locked_dropout_mask_is_constant_over_time(model):
    masks = dropout_masks(model, jax.random.key(3))
    assert masks.inputs.shape == (1, B, E) and masks.output.shape == (1, B, E)
    assert [m.shape for m in masks.hidden] == [(1, B, H)]
    x = jax.random.normal(jax.random.key(4), (T, B, E))
    dropped = locked_dropout(x, masks.inputs)
    ratio = dropped / x
    np.testing.assert_allclose(ratio, jnp.broadcast_to(ratio[:1], ratio.shape), rtol=1e-6)
    np.testing.assert_allclose(np.unique(masks.inputs), [0.0, 1 / 0.6], rtol=1e-6)
    assert locked_dropout(x, None) is x
    with pytest.raises(ValueError, match="mask must have shape"):
        locked_dropout(x, masks.hidden[0])


def test_embedding_dropout_drops_whole_words(model):
    table = jax.random.normal(jax.random.key(0), (V, E))
    ids = jnp.array([[1, 2, 1, 3], [3, 2, 1, 5]])
    row_mask = jnp.zeros((V,)).at[jnp.array([2, 5])].set(2.0)  # keep 2 and 5 (p = 0.5)
    out = embed(table, ids, row_mask)
    np.testing.assert_allclose(out, table[ids] * row_mask[ids][..., None])
    assert jnp.all(out[ids == 1] == 0) and jnp.all(out[ids == 3] == 0)
    np.testing.assert_allclose(out[0, 1], 2.0 * table[2])
    # The model draws one keep factor per vocabulary row: 0 or 1 / (1 - p).
    mask = dropout_masks(model, jax.random.key(1)).embedding
    assert mask.shape == (V,)
    np.testing.assert_allclose(np.unique(mask), [0.0, 1 / 0.8], rtol=1e-6)


def test_weight_drop_masks_w_hh_only_with_one_mask_per_pass(model):
    masks = dropout_masks(model, jax.random.key(5))
    assert [m.shape for m in masks.weights] == [(4 * H, H), (4 * E, E)]
    only_weights = masks._replace(embedding=None, inputs=None, hidden=(None,), output=None)
    graphdef, params = nnx.split(model)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params).rnn(tokens(), masks=only_weights).output ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    for i, mask in enumerate(masks.weights):
        # W_hh: exactly the dropped connections get no gradient, at every step (one mask).
        np.testing.assert_array_equal(grads["layers"][i]["w_hh"][...] == 0, mask == 0)
        assert jnp.all(grads["layers"][i]["w_ih"][...] != 0)  # W_ih is never dropped


def test_ar_and_tar_against_a_plain_computation(model):
    x, y, key = tokens(), tokens(seed=2), jax.random.key(7)
    _, aux = objective(model, x, y, key)
    out = rnn(model, x, dropout_masks(model, key))  # the objective's masks
    dropped, raw = np.asarray(out.output), np.asarray(out.raw_output)
    assert not np.allclose(dropped, raw)  # AR sees the dropped output, TAR the raw one
    np.testing.assert_allclose(aux.ar, ALPHA * np.mean(dropped**2), rtol=1e-5)
    np.testing.assert_allclose(aux.tar, BETA * np.mean((raw[1:] - raw[:-1]) ** 2), rtol=1e-5)


def test_padded_window_with_length_equals_the_unpadded_window(model):
    x, y, key = tokens(), tokens(seed=2), jax.random.key(8)
    full = objective(model, x, y, key)
    pad = lambda a: jnp.pad(a, ((0, 5), (0, 0)))  # noqa: E731
    padded = objective(model, pad(x), pad(y), key, jnp.int32(T))
    chex.assert_trees_all_close(padded, full, rtol=1e-5, atol=1e-7)


def test_carried_state_makes_halves_equal_the_whole_sequence(model):
    x = tokens()
    whole, whole_carry = log_probs(model, x)
    first, carry = log_probs(model, x[:3])
    second, second_carry = log_probs(model, x[3:], carry)
    np.testing.assert_allclose(jnp.concatenate([first, second]), whole, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(second_carry, whole_carry, rtol=1e-5, atol=1e-6)
    assert not np.allclose(log_probs(model, x[3:])[0], second, atol=1e-4)  # the state matters


@pytest.mark.parametrize("name, head", [("model", "softmax"), ("mos_model", "mos")])
def test_tied_embedding_is_one_shared_parameter(name, head, request):
    model = request.getfixturevalue(name)
    assert model.head.decoder is model.embedding.embedding
    graphdef, params = nnx.split(model, nnx.Param)
    untied = nnx.eval_shape(lambda: build(head, tie_weights=False))
    count = lambda m: len(jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert count(untied) == count(model) + 1  # tying saves exactly the decoder table
    # One array in the state: changing it through the embedding changes the decoder.
    params["embedding"]["embedding"] = nnx.Param(params["embedding"]["embedding"][...] + 1.0)
    merged = nnx.merge(graphdef, params)
    np.testing.assert_allclose(merged.head.decoder[...], model.embedding.embedding[...] + 1.0)


def test_mixture_presets_are_the_heads_with_components():
    for name in nn.HEAD_NAMES:
        options = {"num_knots": 10} if "plif" in name else {}
        head = nn.make_head(name, 4, 8, rngs=nnx.Rngs(0), **options)
        assert (
            head.is_mixture
            == nn.is_mixture_preset(name)
            == (name.startswith("mos") or name == "mixtape")
        ), name


def test_mos_model_has_a_latent_mask(mos_model, model):
    assert dropout_masks(mos_model, jax.random.key(0)).latent.shape == (1, B, 3 * E)
    assert dropout_masks(model, jax.random.key(0)).latent is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dropout": 1.0}, "dropout must be in"),
        ({"dropoutl": 0.3}, "dropoutl applies to mixture heads"),
        ({"nhidlast": 9}, "needs nhidlast == emsize"),
        ({"nlayers": 0}, "nlayers must be >= 1"),
        ({"head": "nope"}, "unknown head"),
    ],
)
def test_bad_arguments(options, message):
    with pytest.raises(ValueError, match=message):
        AWDLSTM(V, emsize=E, nhid=H, rngs=nnx.Rngs(0), **options)
