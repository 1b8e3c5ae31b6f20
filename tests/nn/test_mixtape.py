"""Mixtape (Yang et al. 2019) against a float64 NumPy transcription of the paper's equations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bottleneck as bn
from bottleneck import nn
from bottleneck.mixtures import sigmoid_tree_log_weights
from bottleneck.sharding import VocabShard
from tests.head_combos import loss_temp_bytes

D, M, K = 12, 50, 4
COUNTS = (np.arange(M) * 7919) % 13  # first-occurrence ids: frequencies in no order
THRESHOLD = 6  # 27 of the 50 tokens keep their own gate
SHARING = {"token_counts": COUNTS, "shared_gate_below": THRESHOLD}


def _inputs(n=23):
    kh, ky, kw = jax.random.split(jax.random.key(1), 3)
    return (
        2.0 * jax.random.normal(kh, (n, D)),
        jax.random.randint(ky, (n,), 0, M),
        jax.random.bernoulli(kw, 0.8, (n,)),
    )


def _randomize(head, key=7):
    """Non-zero gate biases (zeros at init) so that every term of the equations is exercised."""
    keys = jax.random.split(jax.random.key(key), 2)
    head.gate_bias[...] = jax.random.normal(keys[0], head.gate_bias.shape)
    head.bias[...] = 0.5 * jax.random.normal(keys[1], head.bias.shape)
    if head.shares_gates:
        head.shared_gate_bias[...] = jnp.array([0.3, -0.7, 1.1])[: head.num_gates]
    return head


def reference_log_probs(head, h, frequent=None):
    """The paper's equations in float64 NumPy (Sec. 3.1-3.3), K = 4 and a sigmoid tree.

    h_k = tanh(H_k g + c_k); l_{x,j} = v_x . tanh(U_j g) + u_j . g + b_{x,j} (infrequent x:
    u_j . g + b_{*,j}); gamma = sigma(l); pi_1 = g1 g2, pi_2 = g1 (1 - g2), pi_3 = (1 - g1) g3,
    pi_4 = (1 - g1)(1 - g3); p = softmax_x(sum_k pi_{x,k} h_k . w_x + b_x).
    """
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    g = f64(h)
    n, width = g.shape[0], head.latent_features
    latent = np.tanh(g @ f64(head.latent.kernel[...]) + f64(head.latent.bias[...]))
    latent = latent.reshape(n, K, width)
    w, b = f64(head.decoder[...])[:M], f64(head.bias[...])[:M]
    z = np.einsum("nkd,md->nkm", latent, w)
    q = np.tanh(g @ f64(head.gate_projection.kernel[...])).reshape(n, K - 1, -1)
    context = g @ f64(head.gate_context.kernel[...])  # [n, 3]
    v, bg = f64(head.gate_embedding[...])[:M], f64(head.gate_bias[...])[:M]
    pre = np.einsum("njd,md->njm", q, v) + context[:, :, None] + bg.T[None]
    if frequent is not None:
        shared = context + f64(head.shared_gate_bias[...])
        pre[:, :, ~frequent] = shared[:, :, None]
    g1, g2, g3 = (1.0 / (1.0 + np.exp(-pre[:, j])) for j in range(3))
    pi = np.stack([g1 * g2, g1 * (1 - g2), (1 - g1) * g3, (1 - g1) * (1 - g3)], axis=1)
    logits = np.sum(pi * z, axis=1) + b
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.sum(np.exp(logits - peak), -1, keepdims=True))


def _build(sharing, tied=False, **options):
    rngs = nnx.Rngs(0)
    if tied:
        options["tied_embedding"] = nnx.Embed(M, D, rngs=rngs)
    return nn.make_head(
        "mixtape", D, M, rngs=rngs, num_components=K, memory_budget=3_000,
        **(SHARING if sharing else {}), **options,
    )  # fmt: skip


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sharing", [False, True], ids=["own_gates", "gate_sharing"])
def test_mixtape_matches_the_papers_equations_in_float64(sharing, tied):
    head = _randomize(_build(sharing, tied))
    h, labels, where = _inputs()
    want = reference_log_probs(head, h, COUNTS >= THRESHOLD if sharing else None)
    # One compile, not op-by-op dispatch.
    log_probs, label_log_probs, loss = nnx.jit(
        lambda m: (m(h), m.label_log_probs(h, labels), m.loss(h, labels, where))
    )(head)
    np.testing.assert_allclose(log_probs, want, atol=2e-5)
    picked = want[np.arange(len(labels)), np.asarray(labels)]
    np.testing.assert_allclose(label_log_probs, picked, atol=2e-5)
    w = np.asarray(where)
    np.testing.assert_allclose(loss, -picked[w].mean(), rtol=2e-6)
    if tied:
        assert head.decoder is not None and head.decoder.shape == (M, D)


@pytest.mark.parametrize("sharing", [False, True], ids=["own_gates", "gate_sharing"])
@pytest.mark.parametrize("latent_mask", [False, True])
def test_chunked_loss_and_gradients_equal_the_cross_entropy_of_the_full_log_probs(
    sharing, latent_mask
):
    head = _randomize(_build(sharing))
    h, labels, where = _inputs()
    mask = None
    if latent_mask:
        keep = jax.random.bernoulli(jax.random.key(3), 0.7, (1, K * D))
        mask = jnp.broadcast_to(keep.astype(jnp.float32) / 0.7, (h.shape[0], K * D))
    graphdef, state = nnx.split(head)

    def full(state, h):
        model = nnx.merge(graphdef, state)
        scores, _ = model.mixture_scores(h, mask, vocab=VocabShard(M))
        return bn.cross_entropy(bn.log_normalize(scores[..., 0, :]), labels, where)

    def chunked(state, h):
        return nnx.merge(graphdef, state).loss(h, labels, where, latent_mask=mask)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(state, h)  # noqa: E731
    (want, want_grads), (got, got_grads) = grad(full), grad(chunked)
    assert head.elements_per_token * 23 * 4 * head.buffers_per_element > 3_000  # many chunks
    np.testing.assert_allclose(got, want, rtol=1e-6)
    chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)
    grad_state = got_grads[0]
    for name in ("decoder", "gate_embedding", "gate_bias"):
        assert float(jnp.max(jnp.abs(grad_state[name][...]))) > 0, name
    if sharing:  # the infrequent tokens' own gate rows are unused
        rare = ~(COUNTS >= THRESHOLD)
        assert not np.any(np.asarray(grad_state["gate_embedding"][...])[rare])
        assert float(jnp.max(jnp.abs(grad_state["shared_gate_bias"][...]))) > 0


def test_one_component_is_the_plain_softmax_head():
    mixtape = nn.MixtapeHead(D, M, rngs=nnx.Rngs(0), num_components=1)
    plain = nn.OutputHead(D, M, rngs=nnx.Rngs(0))
    h, labels, _ = _inputs()
    np.testing.assert_array_equal(mixtape(h), plain(h))
    np.testing.assert_array_equal(mixtape.loss(h, labels), plain.loss(h, labels))


def test_equal_gates_give_a_softmax_over_the_mean_context_embedding():
    """With every gate pre-activation 0, the tree gives pi = 1/4 for every token: the gated
    logits are W (sum_k h_k / 4) + b, a plain softmax of rank <= d + 1."""
    head = _randomize(_build(False))
    for name in ("gate_projection", "gate_context"):
        getattr(head, name).kernel[...] = jnp.zeros_like(getattr(head, name).kernel[...])
    head.gate_bias[...] = jnp.zeros_like(head.gate_bias[...])
    h, _, _ = _inputs()
    latents, _ = head.components(h)
    want = jax.nn.log_softmax(latents.mean(-2) @ head.decoder[...].T + head.bias[...])
    np.testing.assert_allclose(head(h), want, atol=2e-6)


def test_all_gates_shared_and_identical_components_is_a_plain_softmax():
    """Every token below the threshold (one shared gate) and H_k = H_1 for all k: sum_k pi_k = 1
    makes the gated logits W h_1 + b whatever the gate: softmax over W tanh(H_1 g + c_1)."""
    head = nn.make_head(
        "mixtape", D, M, rngs=nnx.Rngs(0), token_counts=COUNTS, shared_gate_below=100
    )
    assert head.num_frequent_columns == 0 and head.elements_per_token == M
    kernel, bias = head.latent.kernel[...], head.latent.bias[...]
    head.latent.kernel[...] = jnp.tile(kernel[:, :D], (1, K))
    head.latent.bias[...] = jnp.tile(bias[:D], K)
    head.shared_gate_bias[...] = jnp.array([2.0, -1.0, 0.5])
    h, labels, _ = _inputs()
    first = jnp.tanh(h @ kernel[:, :D] + bias[:D])
    want = jax.nn.log_softmax(first @ head.decoder[...].T + head.bias[...])
    np.testing.assert_allclose(head(h), want, atol=2e-6)
    np.testing.assert_allclose(head.loss(h, labels), bn.cross_entropy(want, labels), rtol=1e-6)


def test_sigmoid_tree_is_the_papers_four_leaf_tree_and_normalized():
    pre = jax.random.normal(jax.random.key(0), (5, 3))
    g = jax.nn.sigmoid(pre)
    want = jnp.stack(
        [g[:, 0] * g[:, 1], g[:, 0] * (1 - g[:, 1]), (1 - g[:, 0]) * g[:, 2],
         (1 - g[:, 0]) * (1 - g[:, 2])], axis=-1,
    )  # fmt: skip
    np.testing.assert_allclose(jnp.exp(sigmoid_tree_log_weights(pre)), want, rtol=1e-6)
    eight = sigmoid_tree_log_weights(jax.random.normal(jax.random.key(1), (2, 7, 3)), axis=1)
    np.testing.assert_allclose(jnp.sum(jnp.exp(eight), axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(sigmoid_tree_log_weights(jnp.zeros((4, 0))), jnp.zeros((4, 1)))
    with pytest.raises(ValueError, match=r"K a power of two, got 2 gates \(K = 3\)"):
        sigmoid_tree_log_weights(jnp.zeros((2,)))


def test_any_number_of_components_takes_a_softmax_gate():
    head = nn.make_head("mixtape", D, M, rngs=nnx.Rngs(0), num_components=3)
    assert head.gate == "softmax" and head.num_gates == 3
    assert nn.make_head("mixtape", D, M, rngs=nnx.Rngs(0)).gate == "sigmoid_tree"
    h, labels, where = _inputs()
    log_probs = head(h)
    np.testing.assert_allclose(jax.nn.logsumexp(log_probs, -1), 0.0, atol=2e-6)
    np.testing.assert_allclose(
        head.loss(h, labels, where), bn.cross_entropy(log_probs, labels, where), rtol=1e-6
    )


def test_log_probability_matrix_has_rank_above_d_plus_one():
    head = _randomize(nn.make_head("mixtape", D, M, rngs=nnx.Rngs(0)))
    h = jax.random.normal(jax.random.key(3), (200, D))
    assert int(bn.numerical_rank(nnx.jit(head)(h))) > D + 1  # jit: not op-by-op dispatch
    shared = _randomize(nn.make_head("mixtape", D, M, rngs=nnx.Rngs(0), **SHARING))
    assert int(bn.numerical_rank(nnx.jit(shared)(h))) > D + 1


# 10% of a 32768-word vocabulary frequent (its own gate), the rest sharing one.
BIG_SHARING = {"token_counts": np.where(np.arange(32768) % 10 == 0, 10, 0), "shared_gate_below": 5}


@pytest.mark.parametrize("sharing", [False, True], ids=["own_gates", "gate_sharing"])
def test_loss_needs_under_a_quarter_of_the_full_logits(sharing):
    """As every head (test_heads.py): compiled temporaries of value_and_grad(loss) at N=4096,
    d=64, M=32768 below a quarter of the full float32 logits."""
    options = BIG_SHARING if sharing else {}
    temp = loss_temp_bytes(
        lambda: nn.make_head("mixtape", 64, 32768, rngs=nnx.Rngs(0), **options), 4096
    )
    assert temp < 4096 * 32768 * 4 / 4


@pytest.mark.parametrize(
    "options",
    [BIG_SHARING, {"gate": "softmax"}, {"gate": "softmax", **BIG_SHARING}],
    ids=["gate_sharing", "softmax_gate", "softmax_gate_sharing"],
)
def test_declared_chunk_cost_with_gate_sharing_and_the_softmax_gate(options):
    """As test_heads.py's test_declared_chunk_costs_are_neither_too_small_nor_wasteful (which
    covers the sigmoid tree without sharing): raising the budget by B raises the temporaries of
    value_and_grad(loss) at N=4096, d=256, M=32768 by 0.5 B to 1.1 B."""
    large = 128 * 2**20
    temp = {
        budget: loss_temp_bytes(
            lambda budget=budget: nn.make_head(
                "mixtape", 256, 32768, rngs=nnx.Rngs(0), memory_budget=budget, **options
            ),
            4096,
        )  # fmt: skip
        for budget in (large, 2 * large)
    }
    assert 0.5 <= (temp[2 * large] - temp[large]) / large <= 1.1, temp


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_components": 3, "gate": "sigmoid_tree"}, "needs num_components a power of two"),
        ({"gate": "tree"}, "unknown gate 'tree'; choose one of sigmoid_tree, softmax"),
        ({"token_counts": COUNTS}, "token_counts and shared_gate_below go together"),
        ({"shared_gate_below": 3}, "token_counts and shared_gate_below go together"),
        (
            {"token_counts": COUNTS[:-1], "shared_gate_below": 3},
            r"token_counts must be numbers of shape \[vocab_size\] = \(50,\)",
        ),
        ({"token_counts": -COUNTS, "shared_gate_below": 3}, "finite and >= 0"),
        ({"token_counts": COUNTS, "shared_gate_below": 0}, "shared_gate_below must be a finite"),
        ({"gate_features": 0}, "gate_features must be >= 1"),
        ({"num_components": 1}, "num_components must be >= 2 for the mixture preset"),
        ({"num_knots": 3}, "head 'mixtape' takes no option num_knots; it takes"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        nn.make_head("mixtape", D, M, rngs=nnx.Rngs(0), **options)
