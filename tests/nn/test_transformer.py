"""Transformer LM: shapes, causality, KV-cache decoding, training, the head's loss, dropout, tying.

Compilation dominates on CPU, so the tests share two models (RoPE + RMSNorm + softmax head;
learned positions + LayerNorm + MoS head) and two compiled entry points per model (cached on
the model's graph), compiled without XLA's backend optimisations (half the compile time; these
tests compile far more than they compute).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bottleneck as bn
from bottleneck import nn
from bottleneck.losses import chunk_size_for_budget
from bottleneck.nn import Transformer
from bottleneck.nn.heads import ProjectedEmbedding
from bottleneck.nn.transformer import (
    TransformerLanguageModel,
    causal_attention,
    rotary_embedding,
)
from tests.jaxprs import equations, inner_jaxprs
from tests.model_jit import jit_model

V, D, L, H, T, B, MAX_LEN = 24, 16, 2, 2, 8, 3, 16
DROPOUT = {"embedding_dropout": 0.1, "residual_dropout": 0.1, "attention_dropout": 0.1}


def build(name="rope", **options):
    if name == "learned":
        options = {
            "position_encoding": "learned", "norm": "layernorm", "head": "mos",
            "num_components": 3, **options,
        }  # fmt: skip
    sizes = {"d_model": D, "num_layers": L, "num_heads": H, "max_len": MAX_LEN}
    return Transformer(V, rngs=nnx.Rngs(0), **{**sizes, **DROPOUT, **options})


MODELS = {"rope": build("rope"), "learned": build("learned")}


@pytest.fixture(params=list(MODELS))
def model(request):
    return MODELS[request.param]


@jit_model
def evaluate(model, x, y, where, key):
    """Full log-probs, the evaluation loss through features + nll, and the training objective."""
    return model(x), model.nll(model.features(x), y, where), model.objective(x, y, key=key)


@jit_model
def decode(model, x, state):
    """Prefill with the first 3 tokens, then one decode step per token: log-probs [B, T - 2, M]."""
    first, state = model.prefill(state, x[:, :3])

    def step(state, token):
        return model.decode_step(state, token)[::-1]

    state, rest = jax.lax.scan(step, state, x[:, 3:].T)
    return jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1), state


def tokens(shape=(B, T), seed=1):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


ALL = np.ones((B, T), bool)


def test_shapes(model):
    lp, eval_nll, (loss, aux) = evaluate(model, tokens(), tokens(seed=2), ALL, jax.random.key(0))
    assert lp.shape == (B, T, V) and lp.dtype == jnp.float32
    np.testing.assert_allclose(jnp.sum(jnp.exp(lp), -1), 1.0, rtol=1e-5)
    assert eval_nll.shape == () and np.isfinite(eval_nll)
    assert loss.shape == () and np.isfinite(loss) and loss == aux.nll
    assert jax.eval_shape(model.features, tokens()).shape == (B, T, D)


def test_a_future_token_cannot_change_a_past_prediction(model):
    x, y, key = tokens(), tokens(seed=2), jax.random.key(0)
    changed = x.copy()
    changed[:, 5] = (x[:, 5] + 1) % V
    before, after = evaluate(model, x, y, ALL, key)[0], evaluate(model, changed, y, ALL, key)[0]
    np.testing.assert_allclose(after[:, :5], before[:, :5], rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[:, 5:], before[:, 5:], atol=1e-4)  # the token is seen from 5 on


def test_kv_cache_decoding_equals_the_full_forward_pass(model):
    x = tokens()
    full = evaluate(model, x, x, ALL, jax.random.key(0))[0]
    # A cache longer than the sequence: its unfilled slots must be invisible.
    steps, state = decode(model, x, model.init_decode_state(B, MAX_LEN))
    assert int(state.length) == T
    # float32 round-off of a different summation order (the cache's masked slots), not more.
    np.testing.assert_allclose(steps, full[:, 2:], rtol=1e-5, atol=2e-5)


def test_a_cache_overflow_is_nan_not_a_plausible_number():
    model = MODELS["rope"]
    steps, _ = decode(
        model, tokens(), model.init_decode_state(B, T - 1)
    )  # T positions, T - 1 slots
    assert np.all(np.isfinite(steps[:, :-1])) and np.all(np.isnan(steps[:, -1]))
    with pytest.raises(ValueError, match="cache's capacity"):
        model.prefill(model.init_decode_state(B, 3), tokens()[:, :4])
    with pytest.raises(ValueError, match="max_len must be in"):
        model.init_decode_state(B, MAX_LEN + 1)


@jit_model
def adapted(model, x, y, length, key):
    """The run loop's view (:class:`TransformerLanguageModel`) of a window padded after length."""
    lm = TransformerLanguageModel(model)
    carry = lm.initial_carry(x.shape[0])
    return (
        lm.nll(x, y, carry, length=length),
        lm.log_probs(x, carry, length=length),
        lm.objective(x, y, carry, key=key, length=length),
    )


def test_the_run_loops_adapter_scores_the_real_steps_only_and_carries_nothing():
    model, real, key = MODELS["rope"], T - 3, jax.random.key(0)
    x, y = tokens(), tokens(seed=2)
    runs = [
        adapted(model, *[np.where(np.arange(T) < real, ids, pad) for ids in (x, y)], real, key)
        for pad in (0, 5)
    ]
    (nll, nll_carry), (lp, lp_carry), (loss, aux) = runs[0]
    assert TransformerLanguageModel(model).initial_carry(B) is None
    assert nll_carry is None and lp_carry is None and aux.carry is None and aux.nll == loss
    # The padding neither counts nor changes the real steps' scores.
    np.testing.assert_allclose(nll, bn.cross_entropy(lp[:, :real], y[:, :real]), rtol=1e-5)
    np.testing.assert_allclose(runs[1][0][0], nll, rtol=1e-6)
    np.testing.assert_allclose(runs[1][1][0][:, :real], lp[:, :real], rtol=1e-6, atol=1e-6)
    assert np.isfinite(loss) and loss != nll  # dropout in the objective


def test_loss_equals_cross_entropy_of_the_full_log_probs(model):
    x, y = tokens(), tokens(seed=2)
    where = np.random.default_rng(3).random((B, T)) < 0.7
    lp, loss, _ = evaluate(model, x, y, where, jax.random.key(0))
    np.testing.assert_allclose(loss, bn.cross_entropy(lp, y, where), rtol=1e-5)


def test_evaluation_is_deterministic_and_training_uses_dropout(model):
    x, y = tokens(), tokens(seed=2)
    run = lambda seed: evaluate(model, x, y, ALL, jax.random.key(seed))  # noqa: E731
    chex.assert_trees_all_equal(run(0), run(0))  # a function of the key
    (lp_0, eval_0, (train_0, _)), (lp_1, eval_1, (train_1, _)) = run(0), run(1)
    chex.assert_trees_all_equal((lp_0, eval_0), (lp_1, eval_1))  # no dropout at evaluation
    assert train_0 != train_1 and train_0 != eval_0  # dropout in training, keyed


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_decreases_with_adamw(name):
    model = MODELS[name]
    x, y = tokens(), tokens(seed=2)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-2)

    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    def step(params, opt_state, key):
        def loss_fn(params):
            return nnx.merge(graphdef, params).objective(x, y, key=key)[0]

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
        for i in range(15):
            params, opt_state = step(params, opt_state, jax.random.key(i))
    before = evaluate(model, x, y, ALL, jax.random.key(0))[1]
    after = evaluate(nnx.merge(graphdef, params), x, y, ALL, jax.random.key(0))[1]
    assert after < 0.7 * before, (before, after)


def test_tied_embedding_is_one_shared_parameter(model):
    assert model.head.decoder is model.embedding.embedding
    untied = nnx.eval_shape(lambda: build(model.position_encoding, tie_weights=False))
    assert untied.head.decoder is not untied.embedding.embedding
    count = lambda m: len(jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert count(untied) == count(model) + 1  # tying saves exactly the decoder table
    graphdef, params = nnx.split(model, nnx.Param)
    params["embedding"]["embedding"] = nnx.Param(params["embedding"]["embedding"][...] + 1.0)
    merged = nnx.merge(graphdef, params)
    np.testing.assert_allclose(merged.head.decoder[...], model.embedding.embedding[...] + 1.0)


def test_rotary_embedding_depends_on_relative_positions_only():
    q, k = np.random.default_rng(0).normal(size=(2, 1, 1, 8)).astype(np.float32)
    positions = jnp.array([0, 3, 10, 100, 37, 7, 97])
    rq = np.asarray(rotary_embedding(jnp.broadcast_to(q, (7, 1, 8)), positions))[:, 0]
    rk = np.asarray(rotary_embedding(jnp.broadcast_to(k, (7, 1, 8)), positions))[:, 0]
    np.testing.assert_allclose(rq[0], q[0, 0], rtol=1e-6)  # position 0: no rotation
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-5)
    # (m, n) = (3, 0), (10, 7), (100, 97): the same offset, the same score.
    scores = [rq[1] @ rk[0], rq[2] @ rk[5], rq[3] @ rk[6]]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
    assert not np.isclose(rq[2] @ rk[1], scores[0], rtol=1e-2)  # offset 7 differs


def test_causal_attention_against_a_loop():
    q, k, v = np.random.default_rng(0).normal(size=(3, 1, 4, 2, 6)).astype(np.float32)
    positions = jnp.arange(4)
    out = np.asarray(
        causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), positions, positions)
    )
    for i in range(4):
        logits = np.einsum("hd,khd->hk", q[0, i], k[0, : i + 1]) / np.sqrt(6)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        np.testing.assert_allclose(
            out[0, i], np.einsum("hk,khd->hd", weights, v[0, : i + 1]), rtol=1e-5, atol=1e-6
        )


def test_bfloat16_parameters():
    # Types only, on an abstract model (nothing is initialised or compiled): float32 outputs,
    # and no implicit promotion anywhere under the tests' strict dtype promotion.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build("learned", param_dtype=jnp.bfloat16)))
    assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(jnp.bfloat16)}

    def run(state, x):
        model = nnx.merge(graphdef, state)
        cache = model.init_decode_state(B, T)
        return model(x), model.objective(x, x, key=jax.random.key(0))[0], model.prefill(cache, x)

    lp, loss, (next_lp, cache) = jax.eval_shape(run, state, tokens())
    assert lp.shape == (B, T, V) and lp.dtype == loss.dtype == next_lp.dtype == jnp.float32
    assert cache.keys[0].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "options, match",
    [
        ({"d_model": 18, "num_heads": 4}, "num_heads must divide d_model"),
        ({"d_model": 18, "num_heads": 2}, "even head size"),
        ({"norm": "batchnorm"}, "norm must be one of"),
        ({"position_encoding": "sinusoidal"}, "position_encoding must be one of"),
        ({"attention_dropout": 1.0}, "attention_dropout must be in"),
        ({"rope_base": float("nan")}, "rope_base"),
        ({"max_len": 0}, "max_len must be >= 1"),
        ({"num_knots": 8}, "takes no option num_knots"),
    ],
)
def test_bad_arguments(options, match):
    with pytest.raises(ValueError, match=match):
        nnx.eval_shape(lambda: build(**options))


def test_bad_inputs():
    model = MODELS["rope"]
    with pytest.raises(ValueError, match="more than max_len"):
        model.features(tokens((B, MAX_LEN + 1)))
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model(tokens((T,)))
    with pytest.raises(ValueError, match="targets must have the shape"):
        model.objective(tokens(), tokens((B, T - 1)))


def test_any_composed_head_through_a_factory():
    """A user's composition (PLIF under sigsoftmax, a 2-component mixture) as the output layer."""

    def head(d, m, *, rngs, **tied):
        return nn.OutputHead(
            d, m, rngs=rngs, pointwise=nn.PLIF(16, noise=0.5, rngs=rngs),
            normalizer="sigsoftmax", num_components=2, latent_features=d, **tied,
        )  # fmt: skip

    model = build(head=head)
    assert model.head.decoder is model.embedding.embedding
    x, y = tokens(), tokens(seed=2)
    log_probs, loss, _ = evaluate(model, x, y, ALL, jax.random.key(0))
    np.testing.assert_allclose(loss, bn.cross_entropy(log_probs, y), rtol=1e-5)
    with pytest.raises(ValueError, match="head_options .* apply to preset names"):
        build(head=head, num_components=3)


@pytest.mark.parametrize("head", ["softmax", "mos"])
def test_head_features_put_the_bottleneck_behind_the_same_trunk(head):
    d = 3  # below d_model: a softmax head's log-probs have rank <= d + 2 (output bias)
    options = {"num_components": 2} if head == "mos" else {}
    narrow = build(head=head, head_features=d, **options)
    wide = build(head=head, **options)
    assert narrow.head.in_features == d and narrow.embedding.embedding.shape[-1] == d
    assert narrow.head.decoder is narrow.embedding.embedding  # the factorized table is tied
    trunk = lambda m: {  # noqa: E731
        k: v.shape for k, v in nnx.to_flat_state(nnx.state(m.blocks, nnx.Param))
    }
    assert trunk(narrow) == trunk(wide)
    check_the_bottleneck(narrow, head, d)


def check_the_bottleneck(model, head, d):
    """Over 96 contexts a softmax head's log-probs have rank <= d + 2 (its output bias), a
    mixture's more; the chunked loss is their cross-entropy, through the projection."""
    x = tokens((6, MAX_LEN), seed=4)
    y = tokens((6, MAX_LEN), seed=5)
    where = np.ones(y.shape, bool)
    # One compile, not op-by-op dispatch.
    full, nll = jit_model(lambda m, x, y, where: (m(x), m.nll(m.features(x), y, where)))(
        model, x, y, where
    )
    log_probs = full.reshape(-1, V)
    np.testing.assert_allclose(jnp.sum(jnp.exp(log_probs), -1), 1.0, rtol=1e-5)
    rank = int(bn.numerical_rank(log_probs))
    if head == "softmax":
        assert rank <= d + 2
    else:
        assert rank > d + 2  # the mixture breaks the bottleneck of its d-wide input
    np.testing.assert_allclose(nll, bn.cross_entropy(full, y), rtol=1e-5)


def test_untied_head_features_keep_a_full_width_embedding():
    model = build(head_features=4, tie_weights=False)
    assert model.embedding.embedding.shape[-1] == D and model.embedding_projection is None
    assert model.head.decoder.shape[-1] == 4 and model.head_projection is not None
    with pytest.raises(ValueError, match="head_features must be >= 1"):
        build(head_features=0)


# ----------------------------------------------------------------------------------------------
# The trunk fixed across d: embedding_features (issue #48)


def _params(model, outside=("head", "head_projection")):
    """Parameter shapes by path, leaving out those under ``outside`` (the head: its Q too)."""
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {path: v.shape for path, v in state if path[0] not in outside}


def test_embedding_features_fix_the_trunk_whatever_d():
    """The study's shapes (M = 10,000, width 128, 2 layers), abstract: at d = 16 and 64 every
    parameter outside the head (its decoder map Q included) and P_out is the same, and it is the
    trunk of the model without a bottleneck; the factorized table changes it with d."""
    sizes = {"d_model": 128, "num_layers": 2, "num_heads": 4, "d_ff": 512, "max_len": 128}

    def study(**options):
        return nnx.eval_shape(lambda: Transformer(10_000, rngs=nnx.Rngs(0), **sizes, **options))

    fixed = {d: study(head_features=d, embedding_features=128) for d in (16, 64)}
    assert _params(fixed[16]) == _params(fixed[64]) == _params(study())
    assert fixed[16].embedding_projection is None  # e = d_model: the table enters as it is
    for d, model in fixed.items():
        assert model.head.decoder.shape == (10_000, d)
        assert model.head.decoder.projection.shape == (128, d)
        assert model.head.decoder.table is model.embedding.embedding
    # Only P_out [128, d] and Q [128, d] grow with d.
    count = lambda m: sum(v.size for v in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert count(fixed[64]) - count(fixed[16]) == 2 * 128 * (64 - 16)
    factorized = {d: study(head_features=d) for d in (16, 64)}
    assert _params(factorized[16]) != _params(factorized[64])
    # A table of another width reaches the trunk through P_in, still the same at every d.
    narrow = {d: study(head_features=d, embedding_features=64) for d in (16, 32)}
    assert _params(narrow[16]) == _params(narrow[32])
    assert narrow[16].embedding_projection.kernel.shape == (64, 128)


@pytest.mark.parametrize("head", ["softmax", "mos", "mixtape"])
def test_the_fixed_trunks_head_keeps_its_bottleneck(head):
    d = 3  # a softmax head's log-probs have rank <= d + 2 (its output bias), the mixtures' more
    options = {} if head == "softmax" else {"num_components": 2}
    model = build(head=head, head_features=d, embedding_features=D, **options)
    assert model.head.decoder.table is model.embedding.embedding
    check_the_bottleneck(model, head, d)


FIXED_TRUNK_HEADS = {
    "softmax": {},
    "plif": {"num_knots": 50},
    "mos": {"num_components": 2},
    "mixtape": {"num_components": 4},
    # The study's Mixtape: 9 of 24 words keep their own gate, in no order of id.
    "mixtape_shared": {
        "num_components": 4, "token_counts": (np.arange(V) * 7) % 5, "shared_gate_below": 3,
    },
}  # fmt: skip


def _fixed_trunk_head(name):
    options = FIXED_TRUNK_HEADS[name]
    model = build(
        head=name.removesuffix("_shared"), head_features=4, embedding_features=D,
        memory_budget=300, **options,
    )  # fmt: skip
    head = model.head
    assert isinstance(head.decoder, ProjectedEmbedding)
    chunk = chunk_size_for_budget(
        18, head.elements_per_token, head.memory_budget, head.buffers_per_element
    )
    assert chunk < 18  # many chunks
    return head


@pytest.mark.parametrize("name", FIXED_TRUNK_HEADS)
def test_the_fixed_trunks_heads_have_the_exact_chunked_loss(name):
    """Every head decoding W = E Q: its loss multiplies E Q out once per call, before the
    chunk loop (and Mixtape with shared gates gathers the product's rows once); in many
    chunks, the loss and every gradient (E's and Q's through the product) equal the
    cross-entropy of the full log-probabilities."""
    head = _fixed_trunk_head(name)
    h = jax.random.normal(jax.random.key(0), (2, 9, 4))
    labels = jax.random.randint(jax.random.key(1), (2, 9), 0, V)
    graphdef, state = nnx.split(head)

    def value_and_grads(loss):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, h)

    chunked, chunked_grads = value_and_grads(lambda s, h: nnx.merge(graphdef, s).loss(h, labels))
    full, full_grads = value_and_grads(
        lambda s, h: bn.cross_entropy(nnx.merge(graphdef, s)(h), labels)
    )
    np.testing.assert_allclose(chunked, full, rtol=1e-6)
    chex.assert_trees_all_close(chunked_grads, full_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FIXED_TRUNK_HEADS)
def test_the_chunk_loop_never_multiplies_e_by_q(name):
    """The product W = E Q and its transposes (dE = dW Q^T, dQ = E^T dW) run once per call,
    outside the chunk loop: no product in the loop reads the table E [V, D]."""
    head = _fixed_trunk_head(name)
    h = jnp.zeros((2, 9, 4))
    labels = jnp.zeros((2, 9), jnp.int32)
    graphdef, state = nnx.split(head)
    jaxpr = jax.make_jaxpr(
        jax.value_and_grad(lambda s, h: nnx.merge(graphdef, s).loss(h, labels), argnums=(0, 1))
    )(state, h)
    loops = [e for e in equations(jaxpr.jaxpr) if e.primitive.name in ("scan", "while")]
    products = [
        tuple(v.aval.shape for v in e.invars)
        for loop in loops
        for body in inner_jaxprs(loop)
        for e in equations(body)
        if e.primitive.name == "dot_general"
    ]
    assert products  # the loop was found: its logits are products
    table = (V, D)
    assert not [p for p in products if table in p or table[::-1] in p], products


def test_the_fixed_trunks_decoder_is_e_q_and_both_train():
    d = 4
    model = build(head_features=d, embedding_features=D)
    decoder = model.head.decoder
    table = np.asarray(model.embedding.embedding[...], np.float64)
    q = np.asarray(decoder.projection[...], np.float64)
    w = table @ q
    np.testing.assert_allclose(decoder[...], w, rtol=1e-5, atol=1e-7)
    # Q ~ N(0, 1 / e): the decoder's entries keep the table's N(0, 0.02^2) scale.
    assert 0.8 < np.std(q) * np.sqrt(D) < 1.2
    assert 0.8 * 0.02 < np.std(w) < 1.2 * 0.02
    # The head's gradient reaches E and Q by the chain rule through W = E Q: dE = dW Q^T and
    # dQ = E^T dW, with dW the gradient of a plain head holding W itself.
    keys = jax.random.split(jax.random.key(3))
    h = jax.random.normal(keys[0], (20, d))
    labels = jax.random.randint(keys[1], (20,), 0, V)

    def head_grads(head):
        graphdef, state = nnx.split(head, nnx.Param)
        return nnx.to_pure_dict(jax.grad(lambda s: nnx.merge(graphdef, s).loss(h, labels))(state))

    plain = nn.OutputHead(d, V, rngs=nnx.Rngs(0), tied_embedding=nnx.Param(decoder[...]))
    grad_w = np.asarray(head_grads(plain)["decoder"], np.float64)
    grads = head_grads(model.head)["decoder"]
    for got, want in ((grads["table"], grad_w @ q.T), (grads["projection"], table.T @ grad_w)):
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    # In the whole model the table is also the input embedding: one parameter, both uses.
    graphdef, params = nnx.split(model, nnx.Param)
    params["embedding"]["embedding"] = nnx.Param(params["embedding"]["embedding"][...] + 1.0)
    merged = nnx.merge(graphdef, params)
    np.testing.assert_allclose(merged.head.decoder.table[...], table + 1.0, rtol=1e-6)


def test_embedding_features_untied_and_bad():
    model = build(head_features=4, embedding_features=8, tie_weights=False)
    assert model.embedding.embedding.shape[-1] == 8
    assert model.embedding_projection.kernel.shape == (8, D)
    assert model.head.decoder.shape == (V, 4) and isinstance(model.head.decoder, nnx.Param)
    with pytest.raises(ValueError, match="embedding_features must be >= 1"):
        build(embedding_features=0)
