r"""Output heads: hidden states ``[..., d]`` -> log-probabilities ``[..., M]`` (Flax NNX).

A head is a composition, not a member of a closed list:

.. math::
   h \to [h_k = \mathrm{latent}_k(h),\ \pi = \mathrm{norm}(w_\pi h)] \to z = W h_k + b
   \to f(z) \to \log g(f(z)) \to \mathrm{log\_normalize} \to \log \textstyle\sum_k \pi_k p_k

:class:`OutputHead` takes its pieces as arguments: a ``pointwise`` map ``f`` (``None``,
:class:`PLIF`, :class:`MonotoneMLP`, or any elementwise increasing callable or ``nnx.Module``),
a ``normalizer`` (a name of :data:`NORMALIZERS` or any callable ``z -> log g(z)``) and
``num_components`` (``> 1``: a mixture) with its ``latent`` map (``"tanh"``, ``"linear"`` or any
callable). ``head(h)`` returns full log-probabilities;
``head.loss(h, labels, where)`` the mean NLL through the one chunked mechanism,
:func:`bottleneck.losses.chunked_cross_entropy`, which never holds the full ``[N, M]`` logits
(nor ``[N, K, M]``). The head holds the maths only: on a mesh (``jax.set_mesh``) the same
computation runs per device through :func:`bottleneck.sharding.run_on_mesh`.

The pieces live in :mod:`bottleneck.nn.pieces`; the papers' named heads ("softmax", "plif",
"mos", "moss", ...) are compositions built by :func:`bottleneck.nn.make_head`
(:mod:`bottleneck.nn.presets`); Mixtape (Yang et al. 2019), one softmax over gated logits, is
:class:`bottleneck.nn.MixtapeHead`, a head of this family that reuses its loss machinery.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bottleneck._checks import require_finite_number, require_int
from bottleneck._vma import reduce_like
from bottleneck.losses import (
    DEFAULT_MEMORY_BUDGET,
    check_label_range,
    chunked_cross_entropy,
    log_partition,
    measure_buffers_per_element,
    nan_unless,
    valid_labels,
)
from bottleneck.mixtures import mixture_log_probs
from bottleneck.nn.pieces import HEAD_BUFFERS_PER_LOGIT, NORMALIZERS, check_increasing
from bottleneck.normalizers import log_normalize
from bottleneck.sharding import (
    VocabShard,
    padded_vocab_size,
    run_on_mesh,
    split_rows_by_vocab,
    vocab_rows_metadata,
)


def affine_logits(
    x: jax.Array, decoder: jax.Array, bias: jax.Array | None, *, reverse_only: bool = False
) -> jax.Array:
    """``x W^T + b``: ``[..., d'] x [M, d'] (+ [M]) -> [..., M]``, accumulated in float32.

    The bias rides in the product as one more input feature (a column of ones in ``x``
    against ``b`` beside ``W``): the logits are written once, not once by the product and again
    by the addition, and ``b``'s gradient comes out of the product's transpose as one more
    column of ``W``'s, not from a second pass over ``[..., M]``. Where the extra column breaks
    a width that was a multiple of 16 and 15 more cost at most an eighth more work, zero
    columns restore it (``d' = 400``: 416 columns, not 401): a row of 401 float32 starts off
    the 64-byte lines the matrix kernels read, and on a 2-core AMD EPYC without AVX-512 the
    three products of the loss took 1.25-1.6x as long at 401 as at 400 or 416
    (docs/benchmarks.md). ``reverse_only``: see :func:`decoder_products` (the chunked loss
    sets it).
    """
    if bias is not None:
        width = x.shape[-1] + 1
        pad = -width % _ALIGNED_COLUMNS
        pad = pad if 8 * pad <= width else 0
        x = jnp.concatenate(
            [x, jnp.ones((*x.shape[:-1], 1), x.dtype), jnp.zeros((*x.shape[:-1], pad), x.dtype)],
            axis=-1,
        )
        columns = [decoder, bias[:, None].astype(decoder.dtype)]
        decoder = jnp.concatenate([*columns, jnp.zeros((decoder.shape[0], pad), decoder.dtype)], 1)
    return decoder_products([x], decoder, reverse_only=reverse_only)[0]


# float32 per 64-byte cache line: the alignment affine_logits keeps its product's rows at.
_ALIGNED_COLUMNS = 16


def decoder_products(
    xs: Sequence[jax.Array], decoder: jax.Array, *, reverse_only: bool = False
) -> list[jax.Array]:
    """``[x W^T for x in xs]``: each ``[..., d']`` against one ``[M, d']``, ``[..., M]`` float32.

    ``reverse_only``: where it saves memory, the gradients through a hand-written VJP (forward
    mode cannot go through it; the chunked loss sets it). One input: ``dz`` is read in its one
    token-major layout, with no transposed copy of ``[..., M]``. Several: autodiff would keep
    each input's share of ``W``'s gradient, a buffer the size of ``W``, until one sum at the end
    (Mixtape's K components at d = 400 held 48 MB beyond its chunk budget); where those shares
    outweigh one copy of every ``dz`` (wide inputs, few tokens), the gradient is one product
    over the ``dz``'s put together.
    """
    rows = [math.prod(x.shape[:-1]) for x in xs]
    # Autodiff's shares: len(xs) [M, d'] buffers; the VJP's: one, and every dz [sum(rows), M].
    if reverse_only and (len(xs) == 1 or sum(rows) < (len(xs) - 1) * decoder.shape[1]):
        flat = [x.reshape(n, x.shape[-1]) for x, n in zip(xs, rows, strict=True)]
        zs = _token_major_products(flat, decoder)
        return [z.reshape(*x.shape[:-1], decoder.shape[0]) for x, z in zip(xs, zs, strict=True)]
    return [jnp.einsum("...d,md->...m", x, decoder, preferred_element_type=jnp.float32) for x in xs]


def row_logits(x: jax.Array, decoder: jax.Array, rows: jax.Array) -> jax.Array:
    """``w_r^T x_k`` ``[..., K]`` for ``x [..., K, d']`` and one decoder row ``r`` per token.

    A label's logit from its own row (a gather of ``[..., d']``), not picked out of the
    ``[..., M]`` logits: the loss's gradient then reaches ``w_y`` through ``[..., d']`` rows
    instead of a one-hot ``[..., M]`` array. ``rows`` ``[...]``: local row indices.
    """
    picked = jnp.take(decoder, rows, axis=0)
    return jnp.einsum("...kd,...d->...k", x, picked, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _token_major_products(xs: list[jax.Array], decoder: jax.Array) -> list[jax.Array]:
    return [jnp.einsum("nd,md->nm", x, decoder, preferred_element_type=jnp.float32) for x in xs]


def _token_major_products_fwd(xs, decoder):
    return _token_major_products(xs, decoder), (xs, decoder)


def _token_major_products_bwd(residuals, dzs):
    # Every gradient reads dz [N, M] as it is, token-major: d decoder = (x^T dz)^T with the
    # small x^T behind a barrier, so that the compiler does not fold the transposes into a
    # dot over dz^T, which it would first write out as a second [M, N] copy of dz.
    xs, decoder = residuals
    # On a mesh: x is the same on every vocabulary shard and the decoder on every data shard;
    # each gets the sum of the shards' contributions.
    grad_xs = [
        reduce_like(jnp.einsum("nm,md->nd", dz, decoder.astype(dz.dtype)).astype(x.dtype), x)
        for x, dz in zip(xs, dzs, strict=True)
    ]
    # The inputs' shares of the decoder's gradient in one product (decoder_products).
    x_t = jnp.concatenate([x.T for x in xs], axis=1).astype(dzs[0].dtype)
    dz = jnp.concatenate(dzs, axis=0)
    grad_decoder = jnp.einsum("dn,nm->dm", jax.lax.optimization_barrier(x_t), dz)
    return grad_xs, reduce_like(grad_decoder.T.astype(decoder.dtype), decoder)


_token_major_products.defvjp(_token_major_products_fwd, _token_major_products_bwd)


def uniform_init(scale: float) -> Callable[..., jax.Array]:
    """``U(-scale, scale)`` initializer (the decoder init of Merity et al. and Yang et al.)."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -scale, scale)

    return init


def padded_rows_init(init: Callable[..., jax.Array], num_rows: int) -> Callable[..., jax.Array]:
    """``init`` for the first ``num_rows`` rows, zeros below (a vocabulary padded for a mesh).

    The real rows are drawn exactly as without padding, so a model starts from the same
    parameters on any mesh.
    """

    def padded(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        real = init(key, (num_rows, *shape[1:]), dtype)
        return jnp.pad(real, [(0, shape[0] - num_rows)] + [(0, 0)] * (len(shape) - 1))

    return padded


class ProjectedEmbedding(nnx.Module):
    r"""A tied decoder read through a learned map: ``W = E Q`` ``[rows, d']``.

    ``E [rows, e]`` is an input embedding's table, shared and not copied (it trains as the
    embedding and as the decoder), ``Q [e, d']`` a learned map drawn ``N(0, 1 / e)``: with
    ``E``'s entries i.i.d. of variance ``s^2``, ``Var (E Q)_{mj} = e s^2 / e = s^2``, so the
    decoder starts at the table's own scale whatever ``e`` and ``d'``. As a head's
    ``tied_embedding`` it is the head's decoder: the logits ``W h + b = E (Q h) + b`` keep a
    softmax head's rank ``<= d' + 1`` while the table may be wider than ``d'`` (weight tying with
    a table of the model's input width, not the bottleneck's; :class:`bottleneck.nn.Transformer`'s
    ``embedding_features``).

    Reading it reads the product: ``decoder[...]`` is ``E Q`` ``[rows, d']`` (in the parameters'
    dtype) and ``decoder.shape`` is ``(rows, d')``, so whatever reads a head's ``decoder`` reads
    ``W``. Each read multiplies again (``rows e d'`` multiply-adds), so a head's loss reads it
    once per call, before its chunk loop: the loop accumulates ``W``'s gradient, and ``E`` and
    ``Q`` get theirs in one product each. (In every chunk, the product and each of its two
    transposes would take ``e / C`` of the chunk's logits' multiply-adds: 1.2 at ``e = 128``
    and PLIF's chunks of ``C = 108`` tokens.) On a mesh the table keeps its split on ``vocab``
    and ``Q`` (no annotation) is replicated, so each device's product is its rows of ``W``,
    split like a decoder.

    Args:
      embedding: an ``nnx.Embed`` or its ``[rows, e]`` ``nnx.Param`` table.
      features: ``d'``, the decoder's width.
      rngs: NNX random streams (``params``) for ``Q``.
      param_dtype: ``Q``'s dtype.
    """

    def __init__(
        self,
        embedding: nnx.Embed | nnx.Param,
        features: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
    ):
        features = require_int("features", features, 1)
        table = embedding.embedding if isinstance(embedding, nnx.Embed) else embedding
        if jnp.ndim(table) != 2:
            raise ValueError(f"embedding must be a [rows, e] table, got shape {jnp.shape(table)}")
        width = table.shape[1]
        self.table = table
        self.projection = nnx.Param(
            nnx.initializers.normal(stddev=width**-0.5)(
                rngs.params(), (width, features), param_dtype
            )
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.table.shape[0], self.projection.shape[1])

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self) -> Any:
        return jnp.result_type(self.table.dtype, self.projection.dtype)

    def __getitem__(self, index: Any) -> jax.Array:
        """``(E Q)[index]``: ``decoder[...]`` is the whole ``[rows, d']`` decoder."""
        return jnp.matmul(self.table[...], self.projection[...])[index]


class OutputHead(nnx.Module):
    r"""An output head composed of a pointwise map, a normalizer and an optional mixture.

    .. math::
       \log p(x \mid h) = \log \sum_{k=1}^{K} \pi_k(h)\,
       \frac{g(f(W h_k + b)_x)}{\sum_m g(f(W h_k + b)_m)}, \qquad
       h_k = \mathrm{latent}_k(h),\ \pi = \mathrm{norm}(w_\pi^\top h)

    with ``K = 1`` meaning ``h_1 = h`` and no prior (a plain head), a decoder ``W`` shared by
    the components, and all mixing in log space. The latent map is a slot: Yang et al.'s
    ``tanh(P_k h + c_k)`` (MoS, the default), identity-initialised linear facets ``P_k h``
    (Chang & McCallum 2022), or any callable. The prior ``pi`` is normalized by the head's
    own normalizer (softmax for MoS, sigsoftmax for MoSS as in Kanai et al.), without ``f``.

    Args:
      in_features: ``d``, size of the hidden states.
      vocab_size: ``M``.
      rngs: NNX random streams (``params``).
      pointwise: ``f``: ``None`` (identity), :class:`PLIF`, :class:`MonotoneMLP`, or any
        callable / ``nnx.Module`` mapping logits elementwise and increasingly (its parameters
        are the head's; one that decreases is refused when probed on a grid of logits:
        :func:`bottleneck.nn.pieces.check_increasing`). It may declare ``buffers_per_logit``
        (see below).
      normalizer: ``"softmax"``, ``"sigsoftmax"``, ``"sigmoid"``, ``"relu"`` (the
        :data:`NORMALIZERS`), a :class:`Normalizer`, or any callable / ``nnx.Module``
        ``z -> log g(z)`` elementwise (e.g. ``lambda z: 2 * z``).
      num_components: ``K >= 1``; ``K > 1`` makes a mixture with latents ``h_k`` of width
        ``latent_features`` (Yang et al. 2018: 15).
      latent: a mixture's latent map ``h [..., d] -> [h_1, ..., h_K]`` (mixtures only):

        * ``"tanh"`` (default): ``h_k = tanh(P_k h + c_k)``, Yang et al. 2018 (eq. 7 of
          "Breaking the softmax bottleneck"), ``[P_1; ...; P_K]`` one ``nnx.Linear`` (its
          default init), exactly the parameters MoS has always had for a seed;
        * ``"linear"``: ``h_k = P_k h``, no bias and no squashing, the linear facets of the
          multi-facet softmax (Chang & McCallum, ACL 2022) and Softmax-CPR (Chang et al.,
          Findings ACL 2023), each ``P_k`` initialised at the identity plus Gaussian noise of
          std :data:`LINEAR_LATENT_NOISE` ``/ sqrt(d)``: ``||(P_k - I) h|| ~ 0.1 ||h||``
          whatever ``d``, so at init every component is the plain head ``W h + b`` up to a
          tenth of its logits (the mixture starts as the plain head, not as a random
          projection of it), while the ``K`` components are distinct points from the first
          step on: their gradients differ by ``O(0.1)`` relative, not by round-off, which
          breaks their symmetry even when the prior is uniform. With ``d' != d`` the identity
          is rectangular (``I[i, j] = [i == j]``, ``d' x d``): ``d' < d`` keeps the first
          ``d'`` features of ``h``, ``d' > d`` pads with features that start as noise only.
        * any callable or ``nnx.Module`` ``h [..., d] -> [..., K * d']``: the ``K`` latents
          concatenated component by component (``[h_1, ..., h_K]``, component ``k`` in
          ``[k d', (k + 1) d')``), fed to the decoder as they are (add your own squashing).
          A module's parameters are the head's and train with it; ``latent_mask`` multiplies
          its output. The output width is checked when the head is called.
      latent_features: ``d'``, width of each ``h_k`` and of the decoder (default ``d``;
        mixtures only).
      tied_embedding: an ``nnx.Embed`` (or its ``[M, d']`` ``nnx.Param``) whose table is used
        as the decoder ``W`` (weight tying, Press & Wolf 2017; Merity et al.), or a
        :class:`ProjectedEmbedding`, a wider table ``E`` read as ``W = E Q``.
      use_bias: learn an output bias ``b`` ``[M]`` (zeros at init).
      memory_budget: bytes one chunk of :meth:`loss` may use.
      param_dtype: dtype of the parameters; logits and reductions are float32 regardless.

    Memory: :meth:`loss` sizes its chunks from the float32 buffers per logit the pieces hold
    at their peak: 2 for the head, plus each piece's ``buffers_per_logit`` when it declares
    one; a piece that does not (a user's callable) is measured once per shape by compiling a
    small chunk (:func:`bottleneck.losses.measure_buffers_per_element`).

    On a mesh: build and call the head inside ``with jax.set_mesh(mesh)`` for a
    ``("data", "vocab")`` mesh (:func:`bottleneck.sharding.make_mesh`); the decoder and bias
    are then stored with :func:`~bottleneck.sharding.padded_vocab_size` rows split on
    ``vocab`` (the extra rows masked out), and :meth:`loss` / :meth:`label_log_probs` run
    data- and vocabulary-parallel.

    Example:
      >>> from flax import nnx
      >>> from bottleneck import nn
      >>> rngs = nnx.Rngs(0)
      >>> head = nn.OutputHead(8, 100, rngs=rngs, pointwise=nn.PLIF(64, rngs=rngs),
      ...                      normalizer="sigsoftmax", num_components=3)
      >>> head(jnp.ones((2, 8))).shape
      (2, 100)
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
        pointwise: Callable[[jax.Array], jax.Array] | None = None,
        normalizer: str | Callable[[jax.Array], jax.Array] = "softmax",
        num_components: int = 1,
        latent_features: int | None = None,
        latent: str | Callable[[jax.Array], jax.Array] = "tanh",
        tied_embedding: nnx.Embed | nnx.Param | ProjectedEmbedding | None = None,
        use_bias: bool = True,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        param_dtype: Any = jnp.float32,
    ):
        if in_features < 1 or vocab_size < 1:
            raise ValueError(
                f"in_features and vocab_size must be >= 1, got {in_features} and {vocab_size}"
            )
        require_finite_number("memory_budget", memory_budget, positive=True)  # bytes
        num_components = require_int("num_components", num_components, 1)
        if latent_features is not None:
            latent_features = require_int("latent_features", latent_features, 1)
            if num_components == 1:
                raise ValueError(
                    "latent_features applies to mixtures (num_components > 1); a plain head "
                    "decodes h itself"
                )
        if num_components == 1 and not (isinstance(latent, str) and latent == "tanh"):
            raise ValueError(
                "latent applies to mixtures (num_components > 1); a plain head decodes h itself"
            )
        if isinstance(latent, str) and latent not in LATENTS:
            raise ValueError(
                f"unknown latent {latent!r}; choose one of {', '.join(LATENTS)} or pass a "
                "callable h -> [..., K * latent_features]"
            )
        if not isinstance(latent, str) and not callable(latent):
            raise ValueError(
                f"latent must be a name ({', '.join(LATENTS)}) or a callable "
                f"h -> [..., K * latent_features], got {latent!r}"
            )
        if pointwise is not None and not callable(pointwise):
            raise ValueError(
                f"pointwise must be None, an nnx.Module or a callable z -> f(z), got {pointwise!r}"
            )
        if pointwise is not None:
            check_increasing(pointwise)
        self.in_features = in_features
        self.vocab_size = vocab_size
        self.memory_budget = memory_budget
        self.num_components = num_components
        self.pointwise = pointwise
        self.normalizer = _resolve_normalizer(normalizer)
        self.latent_features = in_features if latent_features is None else latent_features
        rows = padded_vocab_size(vocab_size)
        if tied_embedding is None:
            self.decoder = nnx.Param(
                padded_rows_init(uniform_init(0.1), vocab_size)(
                    rngs.params(), (rows, self.latent_features), param_dtype
                ),
                **vocab_rows_metadata(2),
            )
        else:
            table = (
                tied_embedding.embedding
                if isinstance(tied_embedding, nnx.Embed)
                else tied_embedding
            )
            if table.shape != (rows, self.latent_features):
                raise ValueError(
                    f"tied_embedding must have shape [padded_vocab_size, {self.latent_features}] "
                    f"= {(rows, self.latent_features)}, got {table.shape}"
                )
            # the shared table lives split like the decoder (E Q: E, and Q replicated)
            split_rows_by_vocab(table.table if isinstance(table, ProjectedEmbedding) else table)
            self.decoder = table
        self.bias = (
            nnx.Param(jnp.zeros((rows,), param_dtype), **vocab_rows_metadata(1))
            if use_bias
            else None
        )
        # The name of the latent map ("tanh", "linear"), or "callable" for a user's.
        self.latent_kind = latent if isinstance(latent, str) else "callable"
        if num_components > 1:
            self.latent = _latent_map(
                latent, in_features, num_components, self.latent_features, rngs, param_dtype
            )
            self._init_mixing(rngs, param_dtype)

    def _init_mixing(self, rngs: nnx.Rngs, param_dtype: Any) -> None:
        """A mixture's parameters beyond its latents: the prior ``w_pi`` ``[d, K]``."""
        self.prior = nnx.Linear(
            self.in_features, self.num_components, use_bias=False, rngs=rngs,
            param_dtype=param_dtype,
        )  # fmt: skip

    @property
    def is_mixture(self) -> bool:
        return self.num_components > 1

    @property
    def elements_per_token(self) -> int:
        """Logits per token (``K * M``), for :meth:`loss`'s chunk sizing."""
        return self.num_components * self.vocab_size

    @property
    def declared_buffers_per_element(self) -> float | None:
        """Float32 buffers per logit at a chunk's peak, if every piece declares its own."""
        pieces = [p for p in (self.pointwise, self.normalizer) if p is not None]
        declared = [getattr(piece, "buffers_per_logit", None) for piece in pieces]
        if any(cost is None for cost in declared):
            return None
        return HEAD_BUFFERS_PER_LOGIT + sum(declared)

    @property
    def buffers_per_element(self) -> float:
        """Float32 buffers per logit at a chunk's peak: declared, or measured for float32 ``h``."""
        declared = self.declared_buffers_per_element
        return _measured_buffers(self, jnp.float32, False) if declared is None else declared

    # ---- the maths ----

    def logits(self, x: jax.Array) -> jax.Array:
        """``W x + b``: ``[..., d'] -> [..., M]`` (this device's rows), accumulated in float32."""
        return affine_logits(x, self.decoder[...], None if self.bias is None else self.bias[...])

    def log_scores(self, z: jax.Array) -> jax.Array:
        """``log g(f(z))``, elementwise: the pointwise map, then the normalizer's log-score."""
        if self.pointwise is not None:
            z = self.pointwise(z)
        return self.normalizer(z)

    def components(
        self, h: jax.Array, latent_mask: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """``h [..., d]`` -> decoder inputs ``[..., K, d']`` and log prior ``[..., K]`` (or None).

        ``latent_mask`` multiplies a mixture's latents (Yang et al.'s latent dropout).
        """
        if not self.is_mixture:
            if latent_mask is not None:
                raise ValueError(
                    "latent_mask applies to mixture heads only; this head has no latents"
                )
            return h[..., None, :], None
        latent = self.latent(h)
        width = self.num_components * self.latent_features
        if jnp.shape(latent) != (*h.shape[:-1], width):
            raise ValueError(
                f"the latent map must return [..., K * latent_features] = [..., {width}] for h "
                f"{h.shape}, got {jnp.shape(latent)}"
            )
        if self.latent_kind == "tanh":
            latent = jnp.tanh(latent)
        if latent_mask is not None:
            latent = latent * latent_mask.astype(latent.dtype)
        latent = latent.reshape(*h.shape[:-1], self.num_components, self.latent_features)
        return latent, self.log_prior(h)

    def log_prior(self, h: jax.Array) -> jax.Array:
        """A mixture's log prior ``log pi(h)`` ``[..., K]``, by the head's own normalizer."""
        return log_normalize(self.normalizer(self.prior(h).astype(jnp.float32)))

    def mixture_scores(
        self, h: jax.Array, latent_mask: jax.Array | None = None, *, vocab: VocabShard
    ) -> tuple[jax.Array, jax.Array | None]:
        """``h [..., d]`` -> log-scores ``[..., K, M_local]`` (padding at ``-inf``), log prior.

        The components' unnormalized log-scores ``log g(f(W h_k + b))`` over this device's
        vocabulary columns ``vocab``, and the log prior ``[..., K]`` (``None``: one component).
        :meth:`__call__` and :meth:`token_log_probs` normalize and mix them; a head of another
        kind (:class:`~bottleneck.nn.MixtapeHead`) overrides only this.
        """
        inputs, log_prior = self.components(h, latent_mask)
        return vocab.mask_padding(self.log_scores(self.logits(inputs))), log_prior

    def score_blocks(
        self,
        h: jax.Array,
        labels: jax.Array,
        latent_mask: jax.Array | None = None,
        *,
        vocab: VocabShard,
        reverse_only: bool = False,
        tables: Any = None,
    ) -> tuple[jax.Array, list[jax.Array], jax.Array | None]:
        """What :meth:`token_log_probs` normalizes: the labels' log-scores and every column's.

        Returns the labels' log-scores ``log g(f(z_y))`` ``[..., K]`` (from their own decoder
        rows, :func:`row_logits`; zero where the label is another device's column), the blocks of log-scores ``[..., K, M_b]`` that together
        hold this device's columns (padding at ``-inf``), and the log prior ``[..., K]``
        (``None``: one component). ``reverse_only``: see :func:`affine_logits`. ``tables``:
        :meth:`loss_tables` (none here). A head of another kind
        (:class:`~bottleneck.nn.MixtapeHead`) overrides this, :meth:`loss_tables` and
        :meth:`mixture_scores`.
        """
        inputs, log_prior = self.components(h, latent_mask)
        decoder = self.decoder[...]
        bias = None if self.bias is None else self.bias[...]
        rows, in_shard = vocab.local_labels(labels, decoder.shape[0])
        z_label = row_logits(inputs, decoder, rows)
        if bias is not None:
            z_label = z_label + jnp.take(bias, rows).astype(jnp.float32)[..., None]
        label_scores = jnp.where(in_shard[..., None], self.log_scores(z_label), 0.0)
        z = affine_logits(inputs, decoder, bias, reverse_only=reverse_only)
        scores = vocab.mask_padding(self.log_scores(z))
        return label_scores, [scores], log_prior

    @property
    def has_loss_tables(self) -> bool:
        """Whether :meth:`loss_tables` gives any (see :class:`~bottleneck.nn.MixtapeHead`)."""
        return False

    def loss_tables(self, vocab: VocabShard) -> Any:
        """Arrays :meth:`score_blocks` derives from the parameters, for :meth:`loss` to derive
        once per call rather than once per chunk (``None``: none)."""
        return None

    def token_log_probs(
        self,
        h: jax.Array,
        labels: jax.Array,
        latent_mask: jax.Array | None = None,
        *,
        vocab: VocabShard | None = None,
        reverse_only: bool = False,
        tables: Any = None,
    ) -> jax.Array:
        r"""``log p(labels | h)`` ``[...]`` from the vocabulary columns ``vocab`` (default: all).

        .. math:: \log p(y) = \log \sum_k \pi_k \exp\big(s_{k,y} - \log Z_k\big)

        with the label's log-score ``s_{k,y}`` from its own decoder row and ``log Z_k`` from
        :func:`~bottleneck.losses.log_partition` over the blocks of :meth:`score_blocks`.
        Labels outside ``[0, M)`` give NaN at their position (value and gradient).
        ``reverse_only``: hand-written gradients that write fewer ``[..., M]`` arrays, for
        reverse mode only (:meth:`loss` sets it; see :func:`affine_logits`). ``tables``: this
        device's :meth:`loss_tables` (derived here when not given).
        """
        vocab = VocabShard(self.vocab_size) if vocab is None else vocab
        check_label_range(labels, vocab.size)
        label_scores, blocks, log_prior = self.score_blocks(
            h, labels, latent_mask, vocab=vocab, reverse_only=reverse_only, tables=tables
        )
        if vocab.axis is not None:  # the label's column lives on one device
            label_scores = jax.lax.psum(label_scores, vocab.axis)
        log_z = log_partition(*blocks, vocab_axis=vocab.axis, reverse_only=reverse_only)
        per_component = label_scores - log_z
        per_component = nan_unless(valid_labels(labels, vocab.size)[..., None], per_component)
        if log_prior is None:
            return per_component[..., 0]
        return jax.nn.logsumexp(per_component + log_prior.astype(jnp.float32), axis=-1)

    # ---- the public interface ----

    def __call__(self, h: jax.Array) -> jax.Array:
        """Full log-probabilities ``[..., M]`` for hidden states ``h [..., d]``."""
        self._check_hidden(h)
        scores, log_prior = self.mixture_scores(h, vocab=VocabShard(self.vocab_size))
        component_log_probs = log_normalize(scores)[..., : self.vocab_size]
        if log_prior is None:
            return component_log_probs[..., 0, :]
        return mixture_log_probs(component_log_probs, log_prior)

    def label_log_probs(
        self, h: jax.Array, labels: jax.Array, latent_mask: jax.Array | None = None
    ) -> jax.Array:
        """``log p(labels | h)`` ``[...]`` for ``h [..., d]``, without normalizing into ``[..., M]``.

        On a mesh the tokens are split on ``data`` and the decoder columns on ``vocab``.
        ``latent_mask``: see :meth:`loss`. Labels must lie in ``[0, M)``: a ``ValueError``
        for concrete labels, NaN at the position of an out-of-range one under tracing
        (``jit``), never a plausible number.
        """
        self._check_hidden(h)
        check_label_range(labels, self.vocab_size)
        constants = self._per_token_latent_mask(h, latent_mask)

        def local(head, h, labels, where, constants, *, vocab, data_axis, devices):
            return head.token_log_probs(h, labels, constants, vocab=vocab)

        return run_on_mesh(self, local, self.vocab_size, h, labels, None, constants, per_token=True)

    def loss(
        self,
        h: jax.Array,
        labels: jax.Array,
        where: jax.Array | None = None,
        *,
        latent_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Mean NLL over unmasked positions, in memory-bounded chunks.

        Equal to ``bn.cross_entropy(self(h), labels, where)`` to float32 round-off, gradients
        included, while peak memory stays within ``memory_budget`` per chunk. On a mesh the
        whole chunk loop runs inside one ``shard_map``: each device takes its block of tokens
        (``data``) and its decoder columns (``vocab``), the normalizers are combined across
        ``vocab`` per chunk and the parameter gradients across ``data`` once.

        Args:
          h: ``[..., d]`` hidden states.
          labels: ``[...]`` integer targets in ``[0, M)``, at masked positions too (pad
            with 0, say). Out of range: ``ValueError`` for concrete labels; under tracing
            (``jit``) the loss and its gradients are NaN, on every mesh.
          where: optional ``[...]`` boolean mask.
          latent_mask: mixture heads only: a multiplicative mask on the latents ``h_k``,
            ``[..., K * d']`` or broadcastable to it (Yang et al.'s latent dropout, e.g. a locked
            mask ``[1, B, K * d']`` for ``h [T, B, d]``).

        Returns:
          Scalar float32 loss.
        """
        self._check_hidden(h)
        check_label_range(labels, self.vocab_size)
        constants = self._per_token_latent_mask(h, latent_mask)
        buffers = self.declared_buffers_per_element
        if buffers is None:
            buffers = _measured_buffers(self, h.dtype, constants is not None)

        def local(head, h, labels, where, constants, *, vocab, data_axis, devices):
            graphdef, state = nnx.split(head)
            # A decoder E Q is multiplied out once per call, not in every chunk: its gradient
            # then accumulates as W's over the chunks and reaches E and Q in one product each.
            product = isinstance(head.decoder, ProjectedEmbedding)
            derived = product or head.has_loss_tables

            def merged(state, decoder):
                head = nnx.merge(graphdef, state)
                if decoder is not None:
                    head.decoder = nnx.Param(decoder)
                return head

            def with_tables(state):
                decoder = nnx.merge(graphdef, state).decoder[...] if product else None
                return state, decoder, merged(state, decoder).loss_tables(vocab)

            def token_log_probs(prepared, h, labels, constants=None):
                state, decoder, tables = prepared if derived else (prepared, None, None)
                return merged(state, decoder).token_log_probs(
                    h, labels, constants, vocab=vocab, reverse_only=True, tables=tables
                )

            shards = 1 if vocab.axis is None else jax.lax.axis_size(vocab.axis)
            return chunked_cross_entropy(
                token_log_probs,
                state,
                h,
                labels,
                where,
                token_constants=constants,
                vocab_size=head.vocab_size,
                # This device's columns and its share of the budget (all devices together
                # hold one chunk of the given budget, as on one device).
                elements_per_token=-(-head.elements_per_token // shards),
                memory_budget=max(head.memory_budget // devices, 1),
                buffers_per_element=buffers,
                data_axis=data_axis,
                prepare=with_tables if derived else None,
            )

        return run_on_mesh(
            self, local, self.vocab_size, h, labels, where, constants, per_token=False
        )

    # ---- argument checks ----

    def _check_hidden(self, h: jax.Array) -> None:
        if jnp.ndim(h) < 1 or jnp.shape(h)[-1] != self.in_features:
            raise ValueError(f"h must have shape [..., {self.in_features}], got {jnp.shape(h)}")

    @property
    def latent_mask_features(self) -> int:
        """Width of a per-token ``latent_mask`` (``K * d'``; 0: the head has no latents)."""
        return self.num_components * self.latent_features if self.is_mixture else 0

    def _per_token_latent_mask(self, h: jax.Array, latent_mask: jax.Array | None) -> Any:
        """``latent_mask`` broadcast to one row per token ``[..., K * d']`` (None stays None)."""
        if latent_mask is None:
            return None
        if not self.is_mixture:
            self.components(h, latent_mask)  # raises the error
        shape = (*h.shape[:-1], self.latent_mask_features)
        try:
            return jnp.broadcast_to(latent_mask, shape).astype(h.dtype)
        except ValueError:
            raise ValueError(
                f"latent_mask must broadcast to {shape} (h {h.shape}), got {jnp.shape(latent_mask)}"
            ) from None


# The latent maps a mixture head knows by name (any callable goes in the same slot).
LATENTS = ("tanh", "linear")
# Std of the identity init's noise of latent="linear", times 1 / sqrt(d): see OutputHead.
LINEAR_LATENT_NOISE = 0.1


def identity_plus_noise_init(noise: float, num_components: int) -> Callable[..., jax.Array]:
    r"""Init of ``K`` linear facets as one kernel ``[d, K d']``: rectangular identities + noise.

    Column block ``k`` is ``P_k^\top = I_{d \times d'} + E_k`` with ``E_k`` i.i.d.
    ``N(0, noise^2 / d)``, so ``P_k h = h + E_k^\top h`` with ``||E_k^\top h|| \approx noise
    \cdot ||h||`` (for ``d' = d``) at any width: the facets start as the plain head's hidden
    state (Chang & McCallum 2022; Softmax-CPR) and differ from one another by ``noise``.
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        d, width = shape
        eye = jnp.eye(d, width // num_components, dtype=dtype)
        scale = jnp.asarray(noise / d**0.5, dtype)
        return jnp.tile(eye, (1, num_components)) + scale * jax.random.normal(key, shape, dtype)

    return init


def _latent_map(
    latent: Any, d: int, num_components: int, width: int, rngs: nnx.Rngs, param_dtype: Any
) -> Any:
    """The latent slot's map ``h [..., d] -> [..., K * width]`` (before any squashing)."""
    if latent == "tanh":
        return nnx.Linear(d, num_components * width, rngs=rngs, param_dtype=param_dtype)
    if latent == "linear":
        return nnx.Linear(
            d, num_components * width, use_bias=False, rngs=rngs, param_dtype=param_dtype,
            kernel_init=identity_plus_noise_init(LINEAR_LATENT_NOISE, num_components),
        )  # fmt: skip
    return nnx.data(latent) if isinstance(latent, nnx.Module) else latent


def _resolve_normalizer(normalizer: Any) -> Callable[[jax.Array], jax.Array]:
    if isinstance(normalizer, str):
        if normalizer not in NORMALIZERS:
            raise ValueError(
                f"unknown normalizer {normalizer!r}; choose one of {', '.join(NORMALIZERS)} "
                "or pass a callable z -> log g(z)"
            )
        return NORMALIZERS[normalizer]
    if not callable(normalizer):
        raise ValueError(
            f"normalizer must be a name ({', '.join(NORMALIZERS)}) or a callable z -> log g(z), "
            f"got {normalizer!r}"
        )
    return normalizer


# Measured chunk costs of heads with undeclared pieces, per (graph, parameter shapes): one
# small compilation per head layout, not per call.
_MEASURED: dict[Any, float] = {}


def _measured_buffers(head: OutputHead, dtype: Any, with_constants: bool) -> float:
    graphdef, state = nnx.split(head)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state)
    key = (graphdef, str(shapes), jnp.dtype(dtype), with_constants)
    if key not in _MEASURED:
        constants = (
            jax.ShapeDtypeStruct((head.latent_mask_features,), dtype) if with_constants else None
        )

        def token_log_probs(state, h, labels, constants=None):
            head = nnx.merge(graphdef, state)
            return head.token_log_probs(h, labels, constants, reverse_only=True)

        _MEASURED[key] = measure_buffers_per_element(
            token_log_probs,
            shapes,
            jax.ShapeDtypeStruct((head.in_features,), dtype),
            elements_per_token=head.elements_per_token,
            token_constants=constants,
        )
    return _MEASURED[key]
