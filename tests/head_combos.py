"""The cross product of head pieces that tests/nn/test_heads.py and tests/sharding_cases.py check.

pointwise {None, PLIF, MonotoneMLP, a user callable} x normalizer {softmax, sigsoftmax, sigmoid,
relu, a user nnx.Module with a parameter} x num_components {1, 3}: 40 heads, built only through
the public composition API; ``PAIRWISE_COMBOS``, 20 of them that hold every pair of pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bottleneck import nn

POINTWISE = ("identity", "plif", "monotone_mlp", "user")
NORMALIZERS = ("softmax", "sigsoftmax", "sigmoid", "relu", "user")
COMPONENTS = (1, 3)
COMBOS = [f"{p}-{n}-{k}" for p, n, k in itertools.product(POINTWISE, NORMALIZERS, COMPONENTS)]
# Every pair of pieces (pointwise x normalizer, pointwise x K, normalizer x K) once: 20 heads.
# A mesh changes how each piece is placed and reduced, not the maths of a pair that one device
# already checks in the full product, so the 8-device tests take this cover (half the compiles).
PAIRWISE_COMBOS = [
    f"{p}-{n}-{COMPONENTS[(i + j) % 2]}"
    for i, p in enumerate(POINTWISE)
    for j, n in enumerate(NORMALIZERS)
]


def user_pointwise(z: jax.Array) -> jax.Array:
    """A user's increasing map, unknown to the library (f' = 1 + 0.5 sech^2 z > 0)."""
    return z + 0.5 * jnp.tanh(z)


class UserNormalizer(nnx.Module):
    """A user's normalizer with a learned parameter: log g(z) = softplus(a) z (a temperature)."""

    def __init__(self, rngs: nnx.Rngs):
        del rngs
        self.raw_temperature = nnx.Param(jnp.asarray(0.3, jnp.float32))

    def __call__(self, z: jax.Array) -> jax.Array:
        return jax.nn.softplus(self.raw_temperature[...]) * z


def build_head(combo: str, in_features: int, vocab_size: int, **options) -> nn.OutputHead:
    pointwise_name, normalizer_name, components = combo.split("-")
    rngs = nnx.Rngs(0)
    if pointwise_name == "plif":
        pointwise = nn.PLIF(16, noise=1.0, rngs=rngs)
    elif pointwise_name == "monotone_mlp":
        pointwise = nn.MonotoneMLP(3, rngs=rngs)
    elif pointwise_name == "user":
        pointwise = user_pointwise
    else:
        pointwise = None
    normalizer = UserNormalizer(rngs) if normalizer_name == "user" else normalizer_name
    return nn.OutputHead(
        in_features, vocab_size, rngs=rngs, pointwise=pointwise, normalizer=normalizer,
        num_components=int(components), **options,
    )  # fmt: skip


# ReLU normalizers: the values they see kept at least this far from the kink at 0.
RELU_MARGIN = 0.1


def keep_relu_off_its_kink(head: nn.OutputHead, h: jax.Array) -> jax.Array | None:
    """A bias [M] that keeps every value a ReLU normalizer sees >= RELU_MARGIN away from 0.

    The ReLU normalizer's gradient is (p - 1[y]) f'(z) / (relu(f(z)) + eps): at f(z) = 2e-3 it is
    ~1/f, and its relative error equals that of f. Two layouts (one device, a mesh; full and
    chunked) differ by reduction-order round-off (~6e-8, CPU-dependent), which such a value
    turned into 6e-5 of absolute gradient deviation - an ill-conditioned input, not an error of
    the code. Rather than loosen the bounds, the inputs avoid the kink: +c on even columns, -c
    on odd ones (both relu branches stay exercised), for the smallest c in a fixed list that
    keeps |f(z)| >= RELU_MARGIN for every component. ``None`` for other normalizers.
    """
    if head.normalizer is not nn.NORMALIZERS["relu"]:
        return None
    sign = jnp.where(jnp.arange(head.vocab_size) % 2 == 0, 1.0, -1.0)
    inputs, _ = head.components(h)
    for offset in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0):
        bias = offset * sign
        z = jnp.einsum("...d,md->...m", inputs, head.decoder[...][: head.vocab_size]) + bias
        if head.pointwise is not None:
            z = head.pointwise(z)
        if float(jnp.min(jnp.abs(z))) >= RELU_MARGIN:
            return bias
    raise AssertionError("no bias keeps the relu inputs off the kink")


def loss_temp_bytes(build: Callable[[], nn.OutputHead], num_tokens: int) -> int:
    """Compiled temporaries of ``value_and_grad(head.loss)`` (w.r.t. its state and ``h``) for
    ``num_tokens`` float32 hidden states, of the head ``build()`` makes: shapes only, nothing
    runs (the head is built under ``nnx.eval_shape``, so no table is initialised)."""
    head = nnx.eval_shape(build)
    graphdef, state = nnx.split(head)
    h = jax.ShapeDtypeStruct((num_tokens, head.in_features), jnp.float32)
    labels = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)

    def loss(state, h, labels):
        return nnx.merge(graphdef, state).loss(h, labels)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(state, h, labels).compile()
    return compiled.memory_analysis().temp_size_in_bytes
