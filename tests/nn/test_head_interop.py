"""A head inside other people's Flax code: a Linen model (through flax.nnx.bridge) and an NNX model
trained with nnx.Optimizer, with a user-defined normalizer among its pieces."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx
from flax.nnx import bridge

import bottleneck as bn
from bottleneck import nn

VOCAB, D = 40, 8


def _batch():
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:]


class LinenBigram(linen.Module):
    """A Linen model (as many research codebases still are) whose output layer is a MoS+PLIF head."""

    @linen.compact
    def __call__(self, inputs, labels, full: bool = False):
        h = jnp.tanh(linen.Dense(D)(linen.Embed(VOCAB, D)(inputs)))
        head = bridge.to_linen(
            nn.make_head, "mos_plif", D, VOCAB, num_components=2, num_knots=32, plif_noise=0.5
        )
        if full:  # the full log-probs, for the reference
            return bn.cross_entropy(head(h), labels)
        return head(h, labels, nnx_method="loss")


def test_head_in_a_linen_model_through_the_bridge():
    model = LinenBigram()
    inputs, labels = _batch()
    variables = jax.jit(model.init)(jax.random.key(0), inputs, labels)

    @functools.partial(jax.jit, static_argnames="full")
    def loss_and_grads(variables, full):
        return jax.value_and_grad(lambda v: model.apply(v, inputs, labels, full=full))(variables)

    loss, grads = loss_and_grads(variables, False)
    full, full_grads = loss_and_grads(variables, True)
    np.testing.assert_allclose(loss, full, rtol=1e-6)
    chex.assert_trees_all_close(grads, full_grads, rtol=1e-5, atol=1e-6)
    slopes = [
        p for path, p in jax.tree_util.tree_leaves_with_path(grads) if "raw_slopes" in str(path)
    ]
    assert len(slopes) == 1 and float(jnp.max(jnp.abs(slopes[0]))) > 0  # PLIF trains in Linen

    tx = optax.adam(3e-2)
    params = variables["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: model.apply({"params": p}, inputs, labels))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam under the suite's strict promotion
        for _ in range(15):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


class ScaledSigmoid(nnx.Module):
    """A user's normalizer: log g(z) = log sigma(a z) with a learned a > 0."""

    def __init__(self):
        self.raw_scale = nnx.Param(jnp.asarray(0.0))

    def __call__(self, z):
        return jax.nn.log_sigmoid(jax.nn.softplus(self.raw_scale[...]) * z)


class NNXBigram(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.head = nn.OutputHead(
            D, VOCAB, rngs=rngs, pointwise=nn.PLIF(32, noise=0.5, rngs=rngs),
            normalizer=ScaledSigmoid(), num_components=2, memory_budget=4_000,
        )  # fmt: skip

    def __call__(self, inputs, labels):
        return self.head.loss(jnp.tanh(self.embed(inputs)), labels)


def test_user_composed_head_in_an_nnx_model_trains_with_nnx_optimizer():
    model = NNXBigram(nnx.Rngs(0))
    inputs, labels = _batch()
    tx = optax.multi_transform(
        {"default": optax.adam(3e-2), "plif_slopes": optax.adam(2e-2)}, nn.param_labels
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    scale_before = float(model.head.normalizer.raw_scale[...])

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: m(inputs, labels))(model)
        optimizer.update(model, grads)
        return loss

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam under the suite's strict promotion
        losses = [float(step(model, optimizer)) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses  # 3.69 -> 2.25 in 15 steps
    assert float(model.head.normalizer.raw_scale[...]) != scale_before  # the user's piece trained
    full = bn.cross_entropy(model.head(jnp.tanh(model.embed(inputs))), labels)
    np.testing.assert_allclose(model(inputs, labels), full, rtol=1e-6)
