"""DenseMoE / dense_moe: shapes, a NumPy reference, constant gates, K = 1, transforms, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bottleneck.nn.moe import DenseMoE, dense_moe

IN, OUT, K = 5, 7, 3


def numpy_dense_moe(x, kernels, biases, gate_kernel, gate_bias, constant_gates=False):
    """Loop-over-experts reference: y = sum_k g_k relu(x W_k + c_k), g = softmax(x V + b)."""
    x = np.asarray(x, np.float64)
    num_experts = kernels.shape[0]
    if constant_gates:
        gates = np.full(x.shape[:-1] + (num_experts,), 1.0 / num_experts)
    else:
        logits = x @ np.asarray(gate_kernel, np.float64) + np.asarray(gate_bias, np.float64)
        logits = logits - logits.max(axis=-1, keepdims=True)
        gates = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    y = np.zeros(x.shape[:-1] + (kernels.shape[-1],))
    for k in range(num_experts):
        expert = np.maximum(x @ np.asarray(kernels[k], np.float64) + np.asarray(biases[k]), 0.0)
        y += gates[..., k : k + 1] * expert
    return y


def random_params(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    return (
        jax.random.normal(keys[0], (2, 4, IN)),
        jax.random.normal(keys[1], (K, IN, OUT)),
        jax.random.normal(keys[2], (K, OUT)),
        jax.random.normal(keys[3], (IN, K)),
        jax.random.normal(keys[4], (K,)),
    )


@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 4)])
@pytest.mark.parametrize("constant_gates", [False, True])
def test_module_shapes(batch_shape, constant_gates):
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(0), constant_gates=constant_gates)
    chex.assert_shape(layer.expert_kernels[...], (K, IN, OUT))
    chex.assert_shape(layer.expert_biases[...], (K, OUT))
    if constant_gates:
        assert layer.gate_kernel is None and layer.gate_bias is None
    else:
        chex.assert_shape(layer.gate_kernel[...], (IN, K))
        chex.assert_shape(layer.gate_bias[...], (K,))
    y = layer(jnp.ones(batch_shape + (IN,)))
    chex.assert_shape(y, batch_shape + (OUT,))
    chex.assert_type(y, jnp.float32)


def test_no_bias_has_no_bias_params():
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(0), use_bias=False)
    assert layer.expert_biases is None and layer.gate_bias is None


def test_matches_numpy_reference():
    x, kernels, biases, gate_kernel, gate_bias = random_params()
    y = dense_moe(x, kernels, biases, gate_kernel, gate_bias)
    expected = numpy_dense_moe(x, kernels, biases, gate_kernel, gate_bias)
    chex.assert_trees_all_close(y, expected.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_module_matches_pure_function():
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(1))
    # Non-zero biases so that they are exercised too.
    layer.expert_biases[...] = jnp.linspace(-1.0, 1.0, K * OUT).reshape(K, OUT)
    layer.gate_bias[...] = jnp.array([0.5, -0.5, 1.0])
    x = jax.random.normal(jax.random.key(2), (6, IN))
    expected = numpy_dense_moe(
        x,
        np.asarray(layer.expert_kernels[...]),
        np.asarray(layer.expert_biases[...]),
        np.asarray(layer.gate_kernel[...]),
        np.asarray(layer.gate_bias[...]),
    )
    chex.assert_trees_all_close(layer(x), expected.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_constant_gates_average_the_experts():
    x, kernels, biases, _, _ = random_params()
    y = dense_moe(x, kernels, biases)
    expected = numpy_dense_moe(x, kernels, biases, None, None, constant_gates=True)
    chex.assert_trees_all_close(y, expected.astype(np.float32), rtol=1e-5, atol=1e-5)
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(0), constant_gates=True)
    chex.assert_trees_all_close(
        layer(x),
        jnp.mean(jax.nn.relu(jnp.einsum("...i,kio->...ko", x, layer.expert_kernels[...])), -2),
        rtol=1e-6,
    )


@pytest.mark.parametrize("constant_gates", [False, True])
def test_one_expert_is_a_dense_layer(constant_gates):
    # With K = 1 the gate is softmax over one logit = 1 (or the constant 1/1): y = relu(x W + c).
    layer = DenseMoE(IN, OUT, 1, rngs=nnx.Rngs(3), constant_gates=constant_gates)
    layer.expert_biases[...] = jnp.full((1, OUT), 0.25)
    x = jax.random.normal(jax.random.key(4), (8, IN))
    dense = jax.nn.relu(x @ layer.expert_kernels[0] + layer.expert_biases[0])
    chex.assert_trees_all_close(layer(x), dense, rtol=1e-6, atol=1e-6)


def test_custom_activations():
    x, kernels, biases, gate_kernel, gate_bias = random_params()
    y = dense_moe(
        x,
        kernels,
        biases,
        gate_kernel,
        gate_bias,
        expert_activation=jnp.tanh,
        gate_activation=jax.nn.sigmoid,
    )
    expert = jnp.tanh(jnp.einsum("...i,kio->...ko", x, kernels) + biases)
    gates = jax.nn.sigmoid(x @ gate_kernel + gate_bias)
    chex.assert_trees_all_close(y, jnp.sum(gates[..., None] * expert, -2), rtol=1e-5)


def test_default_init_is_glorot_per_expert():
    # Glorot uniform on each [in, out] kernel: bound sqrt(6 / (in + out)), not shrunk by K.
    layer = DenseMoE(64, 64, 16, rngs=nnx.Rngs(0))
    bound = np.sqrt(6.0 / 128)
    kernels = np.asarray(layer.expert_kernels[...])
    assert np.abs(kernels).max() <= bound
    np.testing.assert_allclose(kernels.std(), bound / np.sqrt(3), rtol=0.02)


def test_jit_and_vmap():
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(5), (4, IN))
    eager = layer(x)
    chex.assert_trees_all_close(nnx.jit(lambda m, x: m(x))(layer, x), eager, rtol=1e-6)
    chex.assert_trees_all_close(jax.vmap(layer)(x), eager, rtol=1e-6)
    params = random_params()
    pure = jax.jit(jax.vmap(dense_moe, in_axes=(0, None, None, None, None)))(*params)
    chex.assert_trees_all_close(pure, dense_moe(*params), rtol=1e-6)


def test_grad_is_finite():
    x, kernels, biases, gate_kernel, gate_bias = random_params()
    grads = jax.grad(lambda *p: jnp.sum(dense_moe(x, *p)), argnums=(0, 1, 2, 3))(
        kernels, biases, gate_kernel, gate_bias
    )
    chex.assert_tree_all_finite(grads)


def test_low_precision_input_computes_in_float32():
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(6), (3, IN))
    y = layer(x.astype(jnp.bfloat16))
    chex.assert_type(y, jnp.float32)
    chex.assert_trees_all_close(y, layer(x.astype(jnp.bfloat16).astype(jnp.float32)), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_features=0, out_features=2, num_experts=2), "in_features"),
        (dict(in_features=2, out_features=0, num_experts=2), "out_features"),
        (dict(in_features=2, out_features=2, num_experts=0), "num_experts"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DenseMoE(**kwargs, rngs=nnx.Rngs(0))


def test_module_rejects_wrong_input_size():
    layer = DenseMoE(IN, OUT, K, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., in_features\]"):
        layer(jnp.ones((2, IN + 1)))
    with pytest.raises(ValueError, match="x must have shape"):
        layer(jnp.ones(()))


@pytest.mark.parametrize(
    "index, bad, match",
    [
        (0, jnp.ones((2, IN + 1)), "x must have shape"),
        (0, jnp.ones((2, IN), jnp.int32), "x must have a floating dtype"),
        (
            1,
            jnp.ones((IN, OUT)),
            r"expert_kernels must have shape \[K, in_features, out_features\]",
        ),
        (1, jnp.ones((0, IN, OUT)), "at least one expert"),
        (2, jnp.ones((K, OUT + 1)), r"expert_biases must have shape \[K, out_features\]"),
        (3, jnp.ones((IN, K + 1)), r"gate_kernel must have shape \[in_features, K\]"),
        (4, jnp.ones((K + 1,)), r"gate_bias must have shape \[K\]"),
    ],
)
def test_pure_function_rejects_bad_shapes(index, bad, match):
    args = list(random_params())
    args[index] = bad
    with pytest.raises(ValueError, match=match):
        dense_moe(*args)


def test_gate_bias_without_gate_kernel_raises():
    x, kernels, biases, _, gate_bias = random_params()
    with pytest.raises(ValueError, match="gate_bias requires gate_kernel"):
        dense_moe(x, kernels, biases, None, gate_bias)


def test_gate_activation_must_keep_shape():
    with pytest.raises(ValueError, match="gate_activation must keep"):
        dense_moe(*random_params(), gate_activation=lambda z: jnp.sum(z, -1))
