"""The mixture's latent slot: "tanh" (MoS), "linear" (identity-initialised facets), a callable."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bottleneck as bn
from bottleneck import nn
from bottleneck.nn.heads import LINEAR_LATENT_NOISE

D, M, K = 16, 40, 3


def _inputs(n=21):
    kh, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kh, (n, D)), jax.random.randint(ky, (n,), 0, M)


def test_tanh_is_the_default_and_keeps_its_parameters():
    default = nn.make_head("mos", D, M, rngs=nnx.Rngs(0), num_components=K)
    named = nn.make_head("mos", D, M, rngs=nnx.Rngs(0), num_components=K, latent="tanh")
    chex.assert_trees_all_equal(nnx.state(default), nnx.state(named))


@pytest.mark.parametrize("width", [D, 8, 24])
def test_linear_facets_start_at_the_identity_plus_small_noise(width):
    head = nn.OutputHead(
        D, M, rngs=nnx.Rngs(0), num_components=K, latent="linear", latent_features=width
    )
    kernel = np.asarray(head.latent.kernel[...])
    assert head.latent.bias is None
    noise = kernel - np.tile(np.eye(D, width), (1, K))
    np.testing.assert_allclose(noise.std(), LINEAR_LATENT_NOISE / D**0.5, rtol=0.2)
    h, _ = _inputs()
    latents, _ = head.components(h)
    plain = h[:, :width] if width <= D else jnp.pad(h, ((0, 0), (0, width - D)))
    deviation = (
        jnp.linalg.norm(latents - plain[:, None], axis=-1) / jnp.linalg.norm(h, axis=-1)[:, None]
    )
    assert 0.03 < float(jnp.mean(deviation)) < 0.3  # O(noise): distinct, yet near the identity
    # The components differ from one another by O(noise), not by round-off.
    assert float(jnp.min(jnp.abs(latents[:, 0] - latents[:, 1]).max(-1))) > 1e-3


def test_linear_mixture_starts_near_the_plain_head_and_its_loss_is_exact():
    head = nn.make_head("mos", D, M, rngs=nnx.Rngs(0), num_components=K, latent="linear")
    head.bias[...] = jax.random.normal(jax.random.key(2), (M,))
    head.decoder[...] = 3.0 * head.decoder[...]
    h, labels = _inputs()
    plain = jax.nn.log_softmax(h @ head.decoder[...].T + head.bias[...])
    spread = float(jnp.max(plain) - jnp.min(plain))
    # One compile, not op-by-op dispatch.
    log_probs, loss = nnx.jit(lambda m: (m(h), m.loss(h, labels)))(head)
    assert float(jnp.max(jnp.abs(log_probs - plain))) < 0.1 * spread
    np.testing.assert_allclose(loss, bn.cross_entropy(log_probs, labels), rtol=1e-6)


class FacetModule(nnx.Module):
    """A user's latent map with its own parameters: h -> [relu(A_k h)] for k = 1..K."""

    def __init__(self, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (D, K * D)) / D**0.5)

    def __call__(self, h):
        return jax.nn.relu(h @ self.kernel[...])


def test_a_module_in_the_latent_slot_trains_with_the_head():
    head = nn.OutputHead(
        D, M, rngs=nnx.Rngs(0), num_components=K, latent=FacetModule(nnx.Rngs(5)),
        memory_budget=2_000,
    )  # fmt: skip
    assert head.latent_kind == "callable"
    h, labels = _inputs()
    # One compile each, reused by every step, rather than op-by-op dispatch.
    loss = nnx.jit(lambda m: m.loss(h, labels))
    grad = nnx.jit(nnx.grad(lambda m: m.loss(h, labels)))
    full = nnx.jit(nnx.grad(lambda m: bn.cross_entropy(m(h), labels)))(head)
    chunked = grad(head)
    chex.assert_trees_all_close(chunked, full, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(chunked["latent"]["kernel"][...]))) > 0
    before = float(loss(head))
    for _ in range(3):
        grads = grad(head)
        head.latent.kernel[...] = head.latent.kernel[...] - 0.5 * grads["latent"]["kernel"][...]
    assert float(loss(head)) < before


def test_a_plain_callable_goes_in_the_same_slot():
    facets = jax.random.normal(jax.random.key(3), (D, K * D))
    head = nn.make_head(
        "mixtape", D, M, rngs=nnx.Rngs(0), num_components=4,
        latent=lambda h: jnp.tanh(h @ jnp.tile(facets[:, :D], (1, 4))),
    )  # fmt: skip
    h, labels = _inputs()
    # One compile, not op-by-op dispatch.
    loss, log_probs = nnx.jit(lambda m: (m.loss(h, labels), m(h)))(head)
    np.testing.assert_allclose(loss, bn.cross_entropy(log_probs, labels), rtol=1e-6)
    with pytest.raises(
        ValueError, match=r"latent map must return \[\.\.\., K \* latent_features\]"
    ):
        nn.OutputHead(D, M, rngs=nnx.Rngs(0), num_components=K, latent=lambda h: h)(h)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), latent="linear"), "latent applies to"),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), num_components=K, latent="relu"),
            "unknown latent 'relu'; choose one of tanh, linear",
        ),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), num_components=K, latent=3),
            "latent must be a name",
        ),
        (
            lambda: nn.make_head("plif", D, M, rngs=nnx.Rngs(0), latent="linear"),
            "head 'plif' takes no option latent; it takes",
        ),
    ],
)
def test_bad_latents_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()
