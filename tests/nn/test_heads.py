import functools
import json
import pathlib
import re

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
from tests.head_combos import COMBOS, build_head, keep_relu_off_its_kink, loss_temp_bytes

D, M = 16, 64
SMALL_OPTIONS = {
    "plif": {"num_knots": 200, "plif_noise": 1.0},
    "monotone_mlp": {"num_hidden": 5},
    "mos": {"num_components": 3},
    "moss": {"num_components": 3},
    "mos_plif": {"num_components": 3, "num_knots": 200, "plif_noise": 1.0},
    "mixtape": {"num_components": 4},
}


def make(name, **options):
    return nn.make_head(name, D, M, rngs=nnx.Rngs(0), **{**SMALL_OPTIONS.get(name, {}), **options})


def _inputs(shape=(3, 11)):
    kh, ky, kw = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(kh, (*shape, D))
    labels = jax.random.randint(ky, shape, 0, M)
    where = jax.random.bernoulli(kw, 0.7, shape)
    return h, labels, where


def _full_and_chunked(head, h, labels, where):
    graphdef, state = nnx.split(head)

    def full(state, h):
        return bn.cross_entropy(nnx.merge(graphdef, state)(h), labels, where)

    def chunked(state, h):
        return nnx.merge(graphdef, state).loss(h, labels, where)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(state, h)  # noqa: E731
    return grad(full), grad(chunked)


@pytest.mark.parametrize("combo", COMBOS)
def test_every_composition_is_normalized_and_its_chunked_loss_is_the_cross_entropy(combo):
    """pointwise x normalizer x components, user pieces included: head(h) is normalized, and
    head.loss (many chunks, masked) and all its gradients equal bn.cross_entropy(head(h))."""
    head = build_head(combo, D, M, memory_budget=10_000)
    h, labels, where = _inputs()
    bias = keep_relu_off_its_kink(head, h)
    if bias is not None:
        head.bias[...] = bias
    graphdef, state = nnx.split(head)

    @jax.jit
    def run(state, h):
        full = lambda s, h: bn.cross_entropy(nnx.merge(graphdef, s)(h), labels, where)  # noqa: E731
        chunked = lambda s, h: nnx.merge(graphdef, s).loss(h, labels, where)  # noqa: E731
        log_probs = nnx.merge(graphdef, state)(h)
        grads = lambda f: jax.value_and_grad(f, argnums=(0, 1))(state, h)  # noqa: E731
        return jax.nn.logsumexp(log_probs, axis=-1), grads(full), grads(chunked)

    log_total, (full, full_grads), (chunked, chunked_grads) = run(state, h)
    assert chunk_size_for_budget(h.size // D, head.elements_per_token, 10_000) < h.size // D
    np.testing.assert_allclose(log_total, 0.0, atol=2e-6)
    np.testing.assert_allclose(chunked, full, rtol=1e-6)
    chex.assert_trees_all_close(chunked_grads, full_grads, rtol=1e-5, atol=1e-6)
    # Not vacuous: the decoder, h and a user normalizer's parameter get gradients (a constant
    # shift such as the monotone net's bias may get exactly 0: softmax ignores it).
    grad_state, grad_h = chunked_grads
    trained = [grad_state["decoder"][...], grad_h]
    if "normalizer" in grad_state:
        trained.append(grad_state["normalizer"]["raw_temperature"][...])
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in trained)


@pytest.mark.parametrize("combo", COMBOS)
def test_every_composition_loss_needs_under_a_quarter_of_the_full_logits(combo):
    """Compiled temporaries of value_and_grad(head.loss) at N=4096, d=64, M=32768 (full float32
    logits: 512 MiB) stay below a quarter of them: chunk sizing is honest for pieces the library
    knows (declared costs) and for those it does not (measured)."""
    num_tokens, dim, vocab = 4096, 64, 32768
    # Shapes only: no eager initialisation of the tables.
    temp = loss_temp_bytes(lambda: build_head(combo, dim, vocab), num_tokens)
    assert temp < num_tokens * vocab * 4 / 4


PINNED = json.loads((pathlib.Path(__file__).parent / "head_presets_0.1.0.json").read_text())


@pytest.mark.parametrize("name", [name for name in nn.HEAD_NAMES if name in PINNED["presets"]])
def test_presets_give_the_parameters_and_losses_of_the_heads_before_composition(name):
    """Pinned at commit f28879d (nine head classes) by the generator named in the JSON file: the
    same seed gives the same parameters, leaf by leaf, and the same losses. Values, not bytes:
    a uniform draw's last bit depends on the compiler's use of FMA (XLA's -O0 vs -O2, the CPU),
    while a different key or draw order would move every value by O(0.1)."""
    pinned = PINNED["presets"][name]
    options = PINNED["options"].get(name, {})
    head = nn.make_head(name, 6, 13, rngs=nnx.Rngs(0), **options)
    small = nn.make_head(name, 6, 13, rngs=nnx.Rngs(0), memory_budget=2_000, **options)
    params = {
        # Before, PLIF's slopes were the head's own and the monotone net's a dict "monotone".
        jax.tree_util.keystr(path)
        .removesuffix(".value")
        .replace("['pointwise']['raw_slopes']", "['raw_slopes']")
        .replace("['pointwise']", "['monotone']"): np.asarray(value)
        for path, value in jax.tree_util.tree_leaves_with_path(nnx.state(head, nnx.Param))
    }
    assert sorted(params) == sorted(pinned["params"])
    for path, value in params.items():
        np.testing.assert_allclose(
            value, pinned["params"][path], rtol=1e-6, atol=1e-7, err_msg=path
        )
    h = jax.random.normal(jax.random.key(1), (5, 7, 6), jnp.float32) * 2.0
    labels = jax.random.randint(jax.random.key(2), (5, 7), 0, 13)
    where = jax.random.bernoulli(jax.random.key(3), 0.8, (5, 7))
    # One compile, not op-by-op dispatch.
    loss, chunked_loss, log_probs_sum = nnx.jit(
        lambda head, small: (
            head.loss(h, labels, where),
            small.loss(h, labels, where),
            jnp.sum(head(h)),
        )
    )(head, small)
    np.testing.assert_allclose(loss, pinned["loss"], rtol=1e-6)
    np.testing.assert_allclose(chunked_loss, pinned["chunked_loss"], rtol=1e-6)
    np.testing.assert_allclose(log_probs_sum, pinned["log_probs_sum"], rtol=1e-6)


@pytest.mark.parametrize("name", nn.HEAD_NAMES)
def test_label_log_probs_pick_the_labels_from_the_full_log_probs(name):
    head = make(name)
    h, labels, _ = _inputs()
    got = nnx.jit(lambda m, h, y: m.label_log_probs(h, y))(head, h, labels)
    full = nnx.jit(lambda m, h: m(h))(head, h)
    want = jnp.take_along_axis(full, labels[..., None], axis=-1)[..., 0]
    chex.assert_shape(got, labels.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mos", "moss", "mos_plif"])
@pytest.mark.parametrize("memory_budget", [2**30, 10_000], ids=["one_chunk", "many_chunks"])
def test_latent_mask_equals_a_plain_masked_mixture(name, memory_budget):
    """Yang's latent dropout: loss and gradients equal the full masked mixture's."""
    head = make(name, memory_budget=memory_budget)
    h, labels, where = _inputs()
    k, width = head.num_components, head.latent_features
    keep = jax.random.bernoulli(jax.random.key(2), 0.7, (1, 11, k * width))
    mask = keep.astype(jnp.float32) / 0.7
    graphdef, state = nnx.split(head)

    def plain(state, h):
        head = nnx.merge(graphdef, state)
        latent, log_prior = head.components(h)
        latent = latent * mask.reshape(1, 11, k, width)
        log_probs = bn.mixture_log_probs(
            bn.log_normalize(head.log_scores(head.logits(latent))), log_prior
        )
        return bn.cross_entropy(log_probs, labels, where)

    def chunked(state, h):
        return nnx.merge(graphdef, state).loss(h, labels, where, latent_mask=mask)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(state, h)  # noqa: E731
    (want, want_grads), (got, got_grads) = grad(plain), grad(chunked)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)
    unmasked = jax.jit(lambda state, h: nnx.merge(graphdef, state).loss(h, labels, where))
    assert abs(float(unmasked(state, h)) - float(got)) > 1e-3  # the mask is applied


def test_latent_mask_needs_a_mixture_head_and_a_matching_shape():
    h, labels, _ = _inputs()
    with pytest.raises(ValueError, match="latent_mask applies to mixture heads only"):
        make("softmax").loss(h, labels, latent_mask=jnp.ones((1, 11, D)))
    with pytest.raises(ValueError, match=r"latent_mask must broadcast to \(3, 11, 48\)"):
        make("mos").loss(h, labels, latent_mask=jnp.ones((1, 11, 5)))


def test_chunk_size_for_budget():
    assert chunk_size_for_budget(33, M, 2**30) == 33
    assert chunk_size_for_budget(33, M, 10_000) == 9  # 10_000 // (16 * 64): 4 chunks, 1 overlapping
    # 19 tokens fit, so 2 chunks, evened out to 17 (the second repeats one token, not five)
    assert chunk_size_for_budget(33, M, 10_000, buffers_per_element=2) == 17
    assert chunk_size_for_budget(1400, 10_000, 32 * 2**20, buffers_per_element=2) == 350
    assert chunk_size_for_budget(33, 3 * M, 10_000) == 3  # a K = 3 mixture: 11 chunks
    with pytest.raises(ValueError, match="memory_budget must be a positive"):
        chunk_size_for_budget(33, M, 0)


@pytest.mark.parametrize("name", ["softmax", "plif", "mos", "mixtape"])
def test_tied_embedding_shares_and_trains_one_table(name):
    class TiedModel(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(M, D, rngs=rngs)
            extra = {"latent_features": D} if nn.is_mixture_preset(name) else {}
            self.head = nn.make_head(
                name,
                D,
                M,
                rngs=rngs,
                tied_embedding=self.embed,
                **SMALL_OPTIONS.get(name, {}),
                **extra,
            )

        def loss(self, tokens, labels):
            return self.head.loss(self.embed(tokens), labels)

        def full_loss(self, tokens, labels):
            return bn.cross_entropy(self.head(self.embed(tokens)), labels)

    model = TiedModel(nnx.Rngs(0))
    assert model.head.decoder is model.embed.embedding
    tokens, labels = _inputs()[1], jnp.roll(_inputs()[1], 1)

    @nnx.jit  # one compile for every gradient below, rather than op-by-op dispatch
    def gradients(model):
        chunked = nnx.grad(lambda m: m.loss(tokens, labels))(model)
        full = nnx.grad(lambda m: m.full_loss(tokens, labels))(model)
        untied = nnx.grad(
            lambda m: bn.cross_entropy(m.head(jax.lax.stop_gradient(m.embed(tokens))), labels)
        )(model)
        return chunked, full, untied

    chunked, full, untied = gradients(model)
    chex.assert_trees_all_close(chunked, full, rtol=1e-5, atol=1e-6)
    # One shared table: the gradient holds both its embedding and its decoder contributions.
    assert not np.allclose(full["embed"]["embedding"][...], untied["embed"]["embedding"][...])


def test_tied_embedding_shape_is_checked():
    with pytest.raises(
        ValueError, match=r"tied_embedding must have shape \[padded_vocab_size, 16\] = \(64, 16\)"
    ):
        nn.OutputHead(D, M, rngs=nnx.Rngs(0), tied_embedding=nnx.Embed(M, D + 1, rngs=nnx.Rngs(0)))


def test_no_bias_option():
    head = make("sigsoftmax", use_bias=False)
    assert head.bias is None
    h, labels, where = _inputs()
    (full, _), (chunked, _) = _full_and_chunked(head, h, labels, where)
    np.testing.assert_allclose(chunked, full, rtol=1e-6)


@pytest.mark.parametrize("name", nn.HEAD_NAMES)
def test_call_gives_normalized_log_probs_with_any_leading_shape(name):
    head = make(name)
    h, _, _ = _inputs((2, 3, 4))
    log_probs = nnx.jit(lambda m, h: m(h))(head, h)
    chex.assert_shape(log_probs, (2, 3, 4, M))
    np.testing.assert_allclose(jnp.sum(jnp.exp(log_probs), -1), 1.0, atol=1e-5)


def test_rank_of_softmax_head_bounded_others_not():
    """With an output bias, log_softmax(W h + b) has rank <= d + 2 (Kanai Sec. 4.3: 402 for d = 400)."""
    h = jax.random.normal(jax.random.key(3), (200, D))
    ranks = {}
    for name in ("softmax", "sigsoftmax", "plif", "mos", "mixtape"):
        head = make(name)
        if name == "plif":
            slopes = head.pointwise.raw_slopes
            slopes[...] = slopes[...] + 2.0 * jax.random.normal(jax.random.key(4), (200,))
        head.bias[...] = jax.random.normal(jax.random.key(5), (M,))
        ranks[name] = int(bn.numerical_rank(nnx.jit(head)(h)))  # jit: not op-by-op dispatch
    assert ranks["softmax"] <= D + 2
    assert all(ranks[name] > D + 2 for name in ("sigsoftmax", "plif", "mos", "mixtape")), ranks


def test_bfloat16_parameters_accumulate_in_float32():
    head = make("plif", param_dtype=jnp.bfloat16)
    head.pointwise.raw_slopes[...] = head.pointwise.raw_slopes[...].astype(jnp.float32)
    h, labels, _ = _inputs()
    h16 = h.astype(jnp.bfloat16)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(h16, labels))(head)
    assert loss.dtype == jnp.float32
    assert grads["decoder"][...].dtype == jnp.bfloat16
    reference = bn.cross_entropy(head(h16), labels)
    np.testing.assert_allclose(loss, reference, rtol=1e-5)


# Inputs [*lead, width] against one [50, width], through the hand-written VJP: one input (dz
# read token-major), or three wide ones over few rows (one product over the dz's put together).
@pytest.mark.parametrize("count, lead, width", [(1, (2, 32), 4), (3, (4,), 64)])
def test_decoder_products_hand_written_gradients_are_autodiff_s(count, lead, width):
    keys = jax.random.split(jax.random.key(0), count + 2)
    xs = [jax.random.normal(key, (*lead, width)) for key in keys[:count]]
    decoder = jax.random.normal(keys[-2], (50, width))
    weights = jax.random.normal(keys[-1], (count, *lead, 50))

    def loss(xs, decoder, reverse_only):
        zs = nn.heads.decoder_products(xs, decoder, reverse_only=reverse_only)
        return sum(jnp.sum(w * jnp.tanh(z)) for w, z in zip(weights, zs, strict=True))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    hand = jax.make_jaxpr(grads, static_argnums=2)(xs, decoder, True)
    assert "custom_vjp_call" in str(hand)  # the VJP is the one taken
    for got, want in zip(jax.tree.leaves(grads(xs, decoder, True)),
                         jax.tree.leaves(grads(xs, decoder, False)), strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    zs = nn.heads.decoder_products(xs, decoder, reverse_only=True)
    np.testing.assert_allclose(zs[-1], xs[-1] @ decoder.T, rtol=1e-5, atol=1e-5)


# The bias's column of ones is followed by zero columns where that keeps the product's rows
# 64-byte aligned (128 features: 144 columns), and by none where it would not be worth it (4).
@pytest.mark.parametrize("width, columns", [(4, 5), (128, 144)])
@pytest.mark.parametrize("reverse_only", [False, True])
def test_affine_logits_with_its_alignment_columns_is_the_plain_affine_map(
    width, columns, reverse_only
):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (3, 7, width))
    decoder, bias = jax.random.normal(keys[1], (50, width)), jax.random.normal(keys[2], (50,))
    weights = jax.random.normal(keys[3], (3, 7, 50))

    def loss(affine, x, decoder, bias):
        return jnp.sum(weights * jnp.tanh(affine(x, decoder, bias)))

    ours = functools.partial(nn.heads.affine_logits, reverse_only=reverse_only)
    jaxpr = str(jax.make_jaxpr(ours)(x, decoder, bias))
    assert f"f32[50,{columns}]" in jaxpr
    np.testing.assert_allclose(
        ours(x, decoder, bias),
        np.asarray(x, np.float64) @ np.asarray(decoder, np.float64).T + np.asarray(bias),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    plain = jax.grad(functools.partial(loss, lambda x, w, b: x @ w.T + b), argnums=(0, 1, 2))
    got = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(x, decoder, bias)
    for g, want in zip(got, plain(x, decoder, bias), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: nn.make_head("softmaxx", D, M, rngs=nnx.Rngs(0)),
            "unknown head 'softmaxx'; choose one of softmax",
        ),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), normalizer="sigsofmax"),
            "unknown normalizer 'sigsofmax'; choose one of softmax, sigsoftmax, sigmoid, relu",
        ),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), normalizer=3.0),
            "normalizer must be a name",
        ),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), pointwise="plif"),
            "pointwise must be None, an nnx.Module or a callable",
        ),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), num_components=0),
            "num_components must be >= 1",
        ),
        (
            lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), latent_features=4),
            "latent_features applies to mixtures",
        ),
        (lambda: nn.OutputHead(D, 0, rngs=nnx.Rngs(0)), "vocab_size must be >= 1"),
        (lambda: nn.PLIF(1, rngs=nnx.Rngs(0)), "num_knots must be >= 2"),
        (lambda: make("plif", num_knots=0), "num_knots must be >= 2"),
    ],
)
def test_bad_construction_raises(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "pointwise",
    [
        lambda z: -z,
        lambda z: -1e-4 * z,  # slightly: still a reversed ranking
        lambda z: z - 2.0 * jnp.sin(z),  # decreasing near 0 only
        lambda z: z * jnp.linspace(-1.0, 1.0, M),  # per-token: decreasing for some tokens
    ],
)
def test_a_decreasing_pointwise_map_is_refused(pointwise):
    with pytest.raises(ValueError, match="pointwise must be increasing") as error:
        nn.OutputHead(D, M, rngs=nnx.Rngs(0), pointwise=pointwise)
    assert re.search(r"f\(-?[\d.]+\) = \S+ > f\(-?[\d.]+\) = ", str(error.value))
    with pytest.raises(ValueError, match="pointwise must be increasing"):
        nn.MixtapeHead(D, M, rngs=nnx.Rngs(0), pointwise=pointwise)


@pytest.mark.parametrize(
    "pointwise",
    [
        lambda z: z + 0.5 * jnp.tanh(z),
        jnp.tanh,  # saturates to a constant in float32: non-decreasing is allowed
        lambda z: z * jnp.linspace(0.5, 2.0, M),  # per-token slopes, all positive
        lambda z: jnp.exp(z),  # from 1e-28 to 6e27: a steep map is no decrease
    ],
)
def test_increasing_pointwise_maps_are_accepted(pointwise):
    head = nn.OutputHead(D, M, rngs=nnx.Rngs(0), pointwise=pointwise)
    assert head.pointwise is pointwise
    # Built abstractly (no values to probe), nothing is refused or called for real.
    nnx.eval_shape(lambda: nn.OutputHead(D, M, rngs=nnx.Rngs(0), pointwise=lambda z: -z))


@pytest.mark.parametrize(
    "name, options, message",
    [
        # One knot: an affine PLIF, i.e. a softmax with a learned temperature.
        ("plif", {"num_knots": 1}, r"num_knots must be >= 2 \(one knot makes the PLIF affine"),
        ("mos_plif", {"num_knots": 1}, "num_knots must be >= 2"),
        ("plif", {"num_knots": 2.5}, "num_knots must be an integer"),
        ("plif", {"bound": 0.0}, "bound must be a finite number > 0"),
        ("plif", {"bound": -1.0}, "bound must be a finite number > 0"),
        ("plif", {"bound": float("inf")}, "bound must be a finite number > 0"),
        ("plif", {"bound": float("nan")}, "bound must be a finite number > 0"),
        ("mos_plif", {"bound": float("inf")}, "bound must be a finite number > 0"),
        ("plif", {"plif_noise": -1.0}, "noise must be a finite number >= 0"),
        ("plif", {"plif_noise": float("nan")}, "noise must be a finite number >= 0"),
        ("mos", {"num_components": 0}, "num_components must be >= 2"),
        ("moss", {"num_components": -2}, "num_components must be >= 2"),
        # A one-component mixture preset is a plain head with a tanh layer, not a mixture.
        ("mos", {"num_components": 1}, r"num_components must be >= 2 for the mixture preset"),
        # latent_features=0 silently meant "d" before.
        ("mos", {"latent_features": 0}, "latent_features must be >= 1"),
        ("monotone_mlp", {"num_hidden": 0}, "num_hidden must be >= 1"),
        ("relu", {"eps": 0.0}, "eps must be a finite number > 0"),
        ("relu", {"eps": float("inf")}, "eps must be a finite number > 0"),
        ("relu", {"eps": float("nan")}, "eps must be a finite number > 0"),
        ("softmax", {"memory_budget": 0}, "memory_budget must be a finite number > 0"),
    ],
)
def test_degenerate_options_are_refused(name, options, message):
    """Checked when the head is built, naming the option, not when (or if) it misbehaves;
    nn.check_head (what configs and CLIs call, nothing built) refuses the same."""
    with pytest.raises(ValueError, match=message):
        make(name, **options)
    with pytest.raises(ValueError, match=message):
        nn.check_head(name, D, M, **options)


def test_check_head_draws_no_parameters_and_names_the_presets_option():
    nn.check_head("plif", num_knots=10**9)  # abstract: 4 GB of slopes are never allocated
    nn.check_head("mixtape", num_components=4)
    with pytest.raises(ValueError, match="^plif_noise must be a finite number >= 0"):
        nn.check_head("plif", plif_noise=-1.0)
    with pytest.raises(ValueError, match="num_components must be >= 2 for the mixture preset 'mos"):
        nn.check_heads(("softmax", "plif", "mos"), num_components=1, num_knots=4, num_hidden=0)
    with pytest.raises(ValueError, match="num_hidden must be >= 1"):
        nn.check_heads(("monotone_mlp",), num_components=1, num_hidden=0)


def test_two_knots_and_two_components_are_the_smallest_accepted():
    """The least each option allows builds a head of that size, which normalizes (one knot or
    one component is refused: test_degenerate_options_are_refused)."""
    h, _, _ = _inputs()
    for name, options in (("plif", {"num_knots": 2}), ("mos", {"num_components": 2}),
                          ("mos_plif", {"num_components": 2, "num_knots": 2})):  # fmt: skip
        head = make(name, **options)
        shapes = {k: v.shape for k, v in nnx.to_flat_state(nnx.state(head, nnx.Param))}
        if "num_knots" in options:
            assert shapes[("pointwise", "raw_slopes")] == (2,)
        if "num_components" in options:
            assert shapes[("prior", "kernel")] == (D, 2)
        np.testing.assert_allclose(jnp.exp(head(h)).sum(-1), 1.0, rtol=1e-5)


# M itself, far beyond M, negative (jnp indexing would wrap it to the last class).
BAD_LABELS = [M, 10**6, -1]


def _with_bad_label(labels, bad):
    return labels.at[1, 4].set(bad)


@pytest.mark.parametrize("name", nn.HEAD_NAMES)
@pytest.mark.parametrize("bad", BAD_LABELS, ids=str)
def test_out_of_range_labels_raise_when_concrete(name, bad):
    """Before: loss 4.62, a plausible number, for each of these labels."""
    head = make(name)
    h, labels, where = _inputs()
    labels = _with_bad_label(labels, bad)
    message = r"labels must lie in \[0, 64\)"
    with pytest.raises(ValueError, match=message):
        head.loss(h, labels)
    with pytest.raises(ValueError, match=message):  # masked positions are checked too
        head.loss(h, labels, where.at[1, 4].set(False))
    with pytest.raises(ValueError, match=message):
        head.label_log_probs(h, labels)
    with pytest.raises(ValueError, match=message):  # NumPy int64 labels: not narrowed first
        head.loss(h, np.asarray(labels, np.int64).clip(0) + np.int64(2**32) * (bad < 0))


@pytest.mark.parametrize("name", ["softmax", "relu", "plif", "mos", "mos_plif", "mixtape"])
@pytest.mark.parametrize("memory_budget", [2**30, 10_000], ids=["one_chunk", "many_chunks"])
def test_out_of_range_labels_give_nan_under_jit(name, memory_budget):
    """Traced labels cannot be checked in Python: loss, gradients and that label's log-prob
    are NaN (masked position or not), every other log-prob unchanged."""
    head = make(name, memory_budget=memory_budget)
    graphdef, state = nnx.split(head)
    h, labels, where = _inputs()

    @jax.jit
    def run(state, h, labels, where):
        model = nnx.merge(graphdef, state)
        loss, grads = jax.value_and_grad(lambda s: nnx.merge(graphdef, s).loss(h, labels, where))(
            state
        )
        return loss, grads, model.label_log_probs(h, labels)

    _, _, want_log_probs = run(state, h, labels, where)
    for bad in BAD_LABELS:
        for masked in (False, True):
            loss, grads, log_probs = run(
                state, h, _with_bad_label(labels, bad), where.at[1, 4].set(not masked)
            )
            assert bool(jnp.isnan(loss)), (bad, masked, loss)
            assert bool(jnp.all(jnp.isnan(grads["decoder"][...]))), (bad, masked)
            nan = np.zeros(labels.shape, bool)
            nan[1, 4] = True
            np.testing.assert_array_equal(np.isnan(log_probs), nan)
            np.testing.assert_array_equal(log_probs[~nan], want_log_probs[~nan])


def test_bad_call_arguments_raise():
    head = make("softmax")
    h, labels, _ = _inputs()
    with pytest.raises(ValueError, match=r"h must have shape \[\.\.\., 16\]"):
        head.loss(h[..., :-1], labels)
    with pytest.raises(ValueError, match=r"labels must have shape \(3, 11\)"):
        head.loss(h, labels[:, :-1])
    with pytest.raises(ValueError, match="labels must have an integer dtype"):
        head.loss(h, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"h must have shape \[\.\.\., 16\]"):
        head(h[..., :-1])


def test_plif_slopes_get_their_own_learning_rate():
    head = make("mos_plif")
    tx = optax.multi_transform(
        {"default": optax.sgd(0.0), "plif_slopes": optax.sgd(0.02)}, nn.param_labels
    )
    optimizer = nnx.Optimizer(head, tx, wrt=nnx.Param)
    before = nnx.clone(head)
    h, labels, _ = _inputs()
    grads = nnx.grad(lambda m: m.loss(h, labels))(head)
    optimizer.update(head, grads)
    np.testing.assert_array_equal(head.decoder[...], before.decoder[...])
    np.testing.assert_allclose(
        head.pointwise.raw_slopes[...],
        before.pointwise.raw_slopes[...] - 0.02 * grads["pointwise"]["raw_slopes"][...],
        rtol=1e-6,
        atol=1e-7,
    )
    assert not np.array_equal(head.pointwise.raw_slopes[...], before.pointwise.raw_slopes[...])


@pytest.mark.parametrize(
    "name", ["softmax", "sigsoftmax", "plif", "monotone_mlp", "mos", "mixtape"]
)
def test_declared_chunk_costs_are_neither_too_small_nor_wasteful(name):
    """Raising memory_budget by B raises the compiled temporaries of value_and_grad(loss) by
    0.5 B to 1.1 B at N=4096, d=256, M=32768: each piece's declared buffers_per_logit (the
    head's 2, sigsoftmax's +1, PLIF's, the monotone net's per hidden unit, a mixture's K,
    Mixtape's MIXTAPE_BUFFERS_PER_LOGIT) matches what a chunk holds. (That every composition
    stays under a quarter of the full logits is
    test_every_composition_loss_needs_under_a_quarter_of_the_full_logits.)"""
    num_tokens, dim, vocab, large = 4096, 256, 32768, 128 * 2**20
    options = {"plif": {"num_knots": 100_000}, "monotone_mlp": {"num_hidden": 8}}
    options["mos"] = options["mixtape"] = {"num_components": 4}
    temp = {}
    for memory_budget in (large, 2 * large):
        temp[memory_budget] = loss_temp_bytes(
            lambda memory_budget=memory_budget: nn.make_head(
                name, dim, vocab, rngs=nnx.Rngs(0), memory_budget=memory_budget,
                **options.get(name, {}),
            ),
            num_tokens,
        )  # fmt: skip
    assert 0.5 <= (temp[2 * large] - temp[large]) / large <= 1.1, temp


def test_the_naive_loss_needs_three_times_the_full_logits():
    """What the chunked loss saves: plain autodiff of bn.cross_entropy(head(h)) holds > 2x the
    full float32 logits at N=4096, d=256, M=32768."""
    num_tokens, dim, vocab = 4096, 256, 32768
    h = jax.ShapeDtypeStruct((num_tokens, dim), jnp.float32)
    labels = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)
    graphdef, state = nnx.split(nn.OutputHead(dim, vocab, rngs=nnx.Rngs(0)))
    naive = jax.jit(
        jax.value_and_grad(
            lambda s, h, y: bn.cross_entropy(nnx.merge(graphdef, s)(h), y), argnums=(0, 1)
        )
    )
    naive_temp = naive.lower(state, h, labels).compile().memory_analysis().temp_size_in_bytes
    assert naive_temp > 2 * num_tokens * vocab * 4


def test_head_options_keep_only_what_each_head_takes():
    every = {
        "num_knots": 10,
        "bound": 5.0,
        "plif_noise": 0.5,
        "num_components": 3,
        "num_hidden": 4,
        "eps": 1e-6,
    }
    assert nn.head_options("softmax", **every) == {}
    assert nn.head_options("relu", **every) == {"eps": 1e-6}
    assert nn.head_options("plif", **every) == {"num_knots": 10, "bound": 5.0, "plif_noise": 0.5}
    assert nn.head_options("moss", **every) == {"num_components": 3}
    for name in nn.HEAD_NAMES:  # whatever it keeps, the head accepts
        nn.make_head(name, D, M, rngs=nnx.Rngs(0), **nn.head_options(name, **every))
    with pytest.raises(ValueError, match="unknown head 'soft'"):
        nn.head_options("soft", **every)


@pytest.mark.parametrize(
    "name, options, refused",
    [
        ("softmax", {"num_components": 4}, "num_components"),
        ("mos", {"num_knots": 5}, "num_knots"),
        ("plif", {"num_hidden": 3, "eps": 1.0}, "eps, num_hidden"),
    ],
)
def test_make_head_refuses_options_a_preset_does_not_take(name, options, refused):
    with pytest.raises(
        ValueError, match=f"head '{name}' takes no option {refused}; it takes "
    ) as err:
        nn.make_head(name, 8, 20, rngs=nnx.Rngs(0), **options)
    assert "memory_budget" in str(err.value)  # the list names what the head does take
    if name == "mos":
        assert "num_components, latent_features" in str(err.value)
