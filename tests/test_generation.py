"""bn.generate: determinism, greedy decoding, the sampled distribution, top-k / top-p, errors.

Every generate call on one model has the same shapes (SAMPLES prompts of P tokens, N new
tokens), so each model compiles its decoding loop once; the sampling options are traced.
Distributions are checked with a chi-square goodness-of-fit test at significance ALPHA: the
seeds are fixed, so a pass is deterministic, and a wrong sampler fails by orders of magnitude
(each test also checks that its samples reject a nearby wrong distribution).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

import bottleneck as bn
from bottleneck.generation import sampling_log_probs
from bottleneck.nn import AWDLSTM, Transformer
from tests.model_jit import jit_model

V, P, N, SAMPLES = 12, 2, 4, 2000
ALPHA = 1e-3


def varied(model, seed):
    """The model with a large (tied) embedding, output bias and LSTM weights, so that its
    next-token distributions are far from uniform and depend on the context (an initialised
    model's are nearly uniform and the same everywhere, where a wrong sampler could pass)."""
    rng = np.random.default_rng(seed)
    table = model.embedding.embedding
    table.set_value(jnp.asarray(3.0 * rng.normal(size=table.shape), jnp.float32))
    model.head.bias.set_value(jnp.asarray(rng.normal(size=V), jnp.float32))
    for layer in getattr(model, "layers", ()):
        for weights in (layer.w_ih, layer.w_hh):
            weights.set_value(4.0 * weights[...])
    return model


TRANSFORMER = varied(
    Transformer(
        V, d_model=16, num_layers=2, num_heads=2, max_len=8, head="mos", num_components=2,
        rngs=nnx.Rngs(0),
    ),
    seed=1,
)  # fmt: skip
LSTM = varied(AWDLSTM(V, emsize=8, nhid=16, nlayers=2, rngs=nnx.Rngs(0)), seed=2)
MODELS = {"transformer": TRANSFORMER, "awd_lstm": LSTM}

# A model whose next-token distribution is CONTROLLED at every step, whatever the context: a
# zero decoder (tied: the embedding) leaves softmax(bias) for every mixture component.
CONTROLLED = np.array([0.02, 0.3, 0.005, 0.1, 0.15, 0.01, 0.2, 0.03, 0.005, 0.08, 0.04, 0.06])
CONTROLLED_MODEL = nnx.clone(TRANSFORMER)
CONTROLLED_MODEL.embedding.embedding.set_value(jnp.zeros((V, 16)))
CONTROLLED_MODEL.head.bias.set_value(jnp.log(jnp.asarray(CONTROLLED, jnp.float32)))


def prompts(seed=0):
    return np.random.default_rng(seed).integers(0, V, (SAMPLES, P)).astype(np.int32)


def generate(model, prompt=None, seed=0, **options):
    prompt = prompts() if prompt is None else prompt
    return np.asarray(bn.generate(model, prompt, N, key=jax.random.key(seed), **options))


@jit_model
def full_log_probs(model, x):
    """Log-probs ``[B, T, M]`` of a whole batch-major sequence, without any cache or state."""
    if isinstance(model, AWDLSTM):
        return jnp.swapaxes(model(x.T)[0], 0, 1)
    return model(x)


def chi_square_p_value(samples, probs):
    """Goodness of fit of ``samples`` to ``probs``; bins expecting < 5 counts are pooled."""
    observed = np.bincount(samples.ravel(), minlength=len(probs)).astype(float)
    expected = probs / probs.sum() * samples.size
    small = expected < 5
    assert observed[expected == 0].sum() == 0  # an impossible token was sampled
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    return scipy.stats.chisquare(observed[keep], expected[keep]).pvalue


@pytest.mark.parametrize("name", list(MODELS))
def test_a_key_determines_the_tokens(name):
    model = MODELS[name]
    first = generate(model, seed=0)
    assert first.shape == (SAMPLES, N) and first.dtype == np.int32
    assert first.min() >= 0 and first.max() < V
    np.testing.assert_array_equal(generate(model, seed=0), first)
    assert np.mean(generate(model, seed=1) != first) > 0.3


@pytest.mark.parametrize("name", list(MODELS))
def test_top_k_1_is_greedy_decoding(name):
    model = MODELS[name]
    greedy = generate(model, top_k=1)
    np.testing.assert_array_equal(generate(model, seed=5, top_k=1, temperature=0.3), greedy)
    # The reference: argmax of a full forward pass over the sequence so far, every step anew.
    rows = 4
    sequence = np.zeros((rows, P + N), np.int32)
    sequence[:, :P] = prompts()[:rows]
    for t in range(N):
        log_probs = full_log_probs(model, sequence)[:, P + t - 1]
        sequence[:, P + t] = np.argmax(log_probs, axis=-1)
    np.testing.assert_array_equal(greedy[:rows], sequence[:, P:])
    assert len(np.unique(greedy[:rows])) > 2  # the context matters


@pytest.mark.parametrize("temperature, wrong", [(1.0, 0.7), (0.5, 1.0)])
def test_the_first_token_follows_the_model_at_a_temperature(temperature, wrong):
    prompt = np.broadcast_to(prompts()[:1], (SAMPLES, P))
    first = generate(TRANSFORMER, prompt, temperature=temperature)[:, 0]
    padded = np.pad(prompt[:4], ((0, 0), (0, N)))  # the shape the greedy test compiled
    log_probs = np.asarray(full_log_probs(TRANSFORMER, padded)[0, P - 1], np.float64)
    tempered = lambda t: np.exp(log_probs / t) / np.exp(log_probs / t).sum()  # noqa: E731
    assert np.abs(tempered(1.0) - 1 / V).max() > 0.1  # far from uniform
    assert chi_square_p_value(first, tempered(temperature)) > ALPHA
    assert chi_square_p_value(first, tempered(wrong)) < 1e-6  # the test has power


@pytest.mark.parametrize(
    "options, kept",
    [
        ({"top_k": 3}, [1, 6, 4]),
        # Ranked masses 0.3, 0.2, 0.15, 0.1, 0.08: 0.65 < 0.7 before the 4th, 0.75 before the 5th.
        ({"top_p": 0.7}, [1, 6, 4, 3]),
        # top-3 renormalised: 0.46, 0.31, 0.23; 0.46 < 0.6 before the 2nd, 0.77 before the 3rd.
        ({"top_k": 3, "top_p": 0.6}, [1, 6]),
    ],
)
def test_samples_stay_in_the_top_k_and_the_nucleus(options, kept):
    samples = generate(CONTROLLED_MODEL, **options)
    assert set(np.unique(samples)) == set(kept)  # every kept token appears, no other
    allowed = np.zeros(V)
    allowed[kept] = CONTROLLED[kept]
    assert chi_square_p_value(samples, allowed) > ALPHA  # renormalised over the kept tokens
    assert chi_square_p_value(samples, np.where(allowed > 0, 1.0, 0.0)) < 1e-6


def test_sampling_log_probs():
    # One [2, 5] batch throughout (each new shape costs an eager compilation of every op).
    row = np.array([0.1, 0.4, 0.2, 0.2, 0.1])
    log_probs = jnp.log(jnp.asarray(np.stack([row, row[::-1]]), jnp.float32))

    def probs(**options):
        return np.asarray(jnp.exp(sampling_log_probs(log_probs, **options)))

    np.testing.assert_allclose(probs(), [row, row[::-1]], rtol=1e-6)
    # Ties at the k-th value go to the lower id: ids 2 and 3 tie in row 0, ids 1 and 2 in row 1.
    np.testing.assert_allclose(probs(top_k=2)[0], [0, 2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(probs(top_k=2)[1], [0, 1 / 3, 0, 2 / 3, 0], rtol=1e-6)
    np.testing.assert_allclose(probs(top_k=1), [[0, 1, 0, 0, 0], [0, 0, 0, 1, 0]])
    np.testing.assert_allclose(probs(top_p=0.45)[0], [0, 2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(probs(top_p=0.35)[0], [0, 1, 0, 0, 0])
    np.testing.assert_allclose(probs(top_p=1.0), probs(), rtol=1e-6)
    np.testing.assert_allclose(probs(top_k=3, top_p=0.5)[0], [0, 1, 0, 0, 0])  # 0.4/0.8 = 0.5
    sharp = row**2 / np.sum(row**2)
    np.testing.assert_allclose(probs(temperature=0.5)[0], sharp, rtol=1e-5)


def test_awd_lstm_incremental_decoding_equals_its_full_forward_pass():
    x = np.random.default_rng(0).integers(0, V, (4, P + N)).astype(np.int32)

    @jit_model
    def decode(model, x):
        first, state = model.prefill(model.init_decode_state(x.shape[0], x.shape[1]), x[:, :3])
        state, rest = jax.lax.scan(
            lambda state, token: model.decode_step(state, token)[::-1], state, x[:, 3:].T
        )
        return jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)

    np.testing.assert_allclose(
        decode(LSTM, x), full_log_probs(LSTM, x)[:, 2:], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "options, match",
    [
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": 0}, r"top_k must be in \[1, 12\]"),
        ({"top_k": V + 1}, r"top_k must be in \[1, 12\]"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": float("nan")}, "top_p"),
        ({"prompt": np.array([[1, V]])}, r"must lie in \[0, 12\)"),
        ({"prompt": np.array([[-1, 2]])}, r"must lie in \[0, 12\)"),
        ({"prompt": np.zeros((2, 0), np.int32)}, "empty prompt"),
        ({"prompt": np.array([1, 2])}, r"shape \[B, P\]"),
        ({"prompt": np.array([[1.0, 2.0]])}, "integer ids"),
        ({"num_tokens": 0}, "num_tokens must be >= 1"),
        ({"prompt": np.zeros((1, 6), np.int32)}, r"max_len must be in \[1, 8\]"),  # 6 + 4 - 1
    ],
)
def test_bad_arguments(options, match):
    options = {"prompt": np.array([[1, 2]]), "num_tokens": N, **options}
    prompt, num_tokens = options.pop("prompt"), options.pop("num_tokens")
    with pytest.raises(ValueError, match=match):
        bn.generate(TRANSFORMER, prompt, num_tokens, key=jax.random.key(0), **options)


# ---- the decoding interface and HiddenStateDecoder ----------------------------------------------


class TinyGPT(nnx.Module):
    """A user's model with no decoding interface: tokens [B, T] -> log-probs [B, T, M]."""

    def __init__(self, rngs):
        self.vocab_size = V
        self.embed = nnx.Embed(V, 8, rngs=rngs)
        self.out = nnx.Linear(8, V, rngs=rngs)

    def __call__(self, tokens):
        return jax.nn.log_softmax(self.out(self.embed(tokens)))


class NoVocab(nnx.Module):
    init_decode_state = prefill = decode_step = staticmethod(lambda *args: None)


@pytest.mark.parametrize(
    "model, lacks",
    [
        (TinyGPT(nnx.Rngs(0)), "TinyGPT lacks a method init_decode_state, a method prefill, a"),
        (NoVocab(), "NoVocab lacks an integer vocab_size >= 1 (it has None)."),
    ],
)
def test_a_model_without_the_decoding_interface_is_refused_before_tracing(model, lacks):
    with pytest.raises(ValueError) as error:
        bn.generate(model, np.array([[1, 2]]), N, key=jax.random.key(0))
    message = str(error.value)
    assert "model must have the decoding interface bottleneck.generation.DecodingModel" in message
    assert lacks in message and "bn.HiddenStateDecoder(model, head, vocab_size)" in message


class TransformerTrunk(nnx.Module):
    """nn.Transformer's trunk as a user's model: tokens -> the head's input, no cache."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens):
        return self.model.head_input(self.model.features(tokens))


# The Transformer's own weights behind the adapter (shared, not copied).
ADAPTED = bn.HiddenStateDecoder(TransformerTrunk(TRANSFORMER), TRANSFORMER.head, V, max_len=8)


def test_hidden_state_decoder_gives_the_cached_decoders_log_probs_at_every_step():
    x = prompts(3)[:8]
    x = np.concatenate([x, np.random.default_rng(4).integers(0, V, (8, N - 1))], axis=1)

    @jit_model
    def decode(model, x):
        first, state = model.prefill(model.init_decode_state(x.shape[0], x.shape[1]), x[:, :P])
        state, rest = jax.lax.scan(
            lambda state, token: model.decode_step(state, token)[::-1], state, x[:, P:].T
        )
        return jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)

    cached, adapted = decode(TRANSFORMER, x), decode(ADAPTED, x)
    assert adapted.shape == (8, N, V)
    np.testing.assert_allclose(adapted, cached, rtol=1e-5, atol=1e-5)
    # And both are the full forward pass over each prefix.
    np.testing.assert_allclose(adapted, full_log_probs(TRANSFORMER, x)[:, P - 1 :], atol=1e-5)


def test_hidden_state_decoder_samples_the_tokens_the_cached_decoder_does():
    prompt = prompts()[:64]
    for options in ({}, {"temperature": 0.7, "top_p": 0.9}, {"top_k": 1}):
        adapted = generate(ADAPTED, prompt, seed=3, **options)
        np.testing.assert_array_equal(adapted, generate(TRANSFORMER, prompt, seed=3, **options))
    greedy = generate(ADAPTED, prompt, seed=0, top_k=1)
    np.testing.assert_array_equal(generate(ADAPTED, prompt, seed=9, top_k=1), greedy)
    assert len(np.unique(greedy)) > 2  # the context matters


def test_hidden_state_decoder_refuses_what_it_cannot_decode():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"max_len must be in \[1, 8\]"):  # 6 + 4 - 1 > 8
        bn.generate(ADAPTED, np.zeros((1, 6), np.int32), N, key=key)
    flat = bn.HiddenStateDecoder(lambda tokens: tokens.astype(jnp.float32), TRANSFORMER.head, V)
    with pytest.raises(ValueError, match=r"model must map tokens \[B, T\] = \(1, 5\) to hidden"):
        bn.generate(flat, np.array([[1, 2]]), N, key=key)
    narrow = bn.HiddenStateDecoder(TransformerTrunk(TRANSFORMER), lambda h: h, V)
    with pytest.raises(ValueError, match=r"head must map h \[B, d\] to log-probabilities"):
        bn.generate(narrow, np.array([[1, 2]]), N, key=key)
    with pytest.raises(ValueError, match=r"pad_id must be in \[0, 12\)"):
        bn.HiddenStateDecoder(TransformerTrunk(TRANSFORMER), TRANSFORMER.head, V, pad_id=V)
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        bn.HiddenStateDecoder(TransformerTrunk(TRANSFORMER), TRANSFORMER.head, 0)
