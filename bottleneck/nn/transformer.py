"""Decoder-only Transformer language model (GPT-2 style) with any output head.

Data flow of one forward pass over ``tokens [B, T]`` (batch-major)::

    token embedding (+ learned positions) -> dropout
    -> L x pre-norm block:  x = x + drop(attn(norm(x)))      (causal; RoPE on q and k)
                            x = x + drop(mlp(norm(x)))       (GELU)
    -> final norm -> [head_features: projection to d] -> head (log-probs / chunked loss)

The architecture is GPT-2's (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners": pre-norm blocks, a final norm, ``N(0, 0.02)`` initialisation with the residual
projections scaled by ``1 / sqrt(2 L)``), with rotary position embeddings (Su et al. 2021,
"RoFormer: Enhanced Transformer with Rotary Position Embedding") by default and learned
absolute positions as an option, RMSNorm or LayerNorm. The head is any of
:data:`bottleneck.nn.HEAD_NAMES` and sits at ``d_model``: the softmax bottleneck is
``rank <= d_model + 1`` exactly as for the AWD-LSTM. With ``head_features = d`` the head sits at a
width ``d`` of its own, behind a learned projection, while the trunk stays as it is: the
bottleneck can then be tightened without shrinking the model.

The pure functions come first; :class:`Transformer` holds the parameters and calls them.
Randomness is explicit as in :mod:`bottleneck.nn.awd_lstm`: a forward pass draws its dropout
masks from one ``key`` (``None``: deterministic evaluation), so the model holds parameters only
and a training step is a pure function of ``(params, batch, key)``.

Incremental decoding keeps every layer's keys and values in a :class:`KVCache` of explicit
arrays (:meth:`Transformer.init_decode_state`, :meth:`~Transformer.prefill`,
:meth:`~Transformer.decode_step`), the interface :func:`bottleneck.generate` drives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from bottleneck.nn.awd_lstm import inverted_dropout_masks, time_mask
from bottleneck.nn.heads import OutputHead, ProjectedEmbedding, padded_rows_init
from bottleneck.nn.presets import is_mixture_preset, make_head
from bottleneck.sharding import padded_vocab_size

POSITION_ENCODINGS = ("rope", "learned")
NORMS = ("rmsnorm", "layernorm")
INIT_STD = 0.02  # GPT-2's initialisation scale


class KVCache(NamedTuple):
    """Keys and values of every layer for incremental decoding.

    Attributes:
      keys: one ``[B, S, H, D_h]`` array per layer (``S``: the capacity in positions).
      values: the same for the values.
      length: int32 scalar, how many positions ``0 .. length - 1`` are filled.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    length: jax.Array


class TransformerAux(NamedTuple):
    """What :meth:`Transformer.objective` reports besides the loss."""

    nll: jax.Array


class StatelessAux(NamedTuple):
    """What :meth:`TransformerLanguageModel.objective` reports: the NLL, and no carry."""

    nll: jax.Array
    carry: None = None


# ----------------------------------------------------------------------------------------------
# Pure functions


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    r"""Rotary position embedding (RoPE; Su et al. 2021, eq. 34) of queries or keys.

    Feature ``i < D/2`` and feature ``i + D/2`` of a vector at position ``m`` are rotated as one
    pair by the angle ``m θ_i``, ``θ_i = base^{-2i/D}``:

    .. math::
       \begin{pmatrix} x'_i \\ x'_{i+D/2} \end{pmatrix} =
       \begin{pmatrix} \cos m\theta_i & -\sin m\theta_i \\ \sin m\theta_i & \cos m\theta_i
       \end{pmatrix} \begin{pmatrix} x_i \\ x_{i+D/2} \end{pmatrix}

    so that the product of a rotated query at ``m`` and a rotated key at ``n`` depends on
    ``m - n`` only (Su et al., eq. 16). Pairing the two halves (the GPT-NeoX layout) instead of
    adjacent features (the paper's) is the same map up to a fixed permutation of the
    projection's outputs.

    Args:
      x: ``[..., T, H, D]`` with ``D`` even (heads ``H``, head size ``D``).
      positions: ``[T]`` integer positions.
      base: the wavelength base (10,000 in the paper).

    Returns:
      ``[..., T, H, D]`` in ``x``'s dtype (the rotation is computed in float32).
    """
    if jnp.ndim(x) < 3 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape [..., T, H, D] with D even, got {jnp.shape(x)}")
    if jnp.shape(positions) != (x.shape[-3],):
        raise ValueError(f"positions must have shape [T] = {(x.shape[-3],)}, got {positions.shape}")
    half = x.shape[-1] // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # θ_i = base^(-2i/D)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, D/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_positions: jax.Array,
    key_positions: jax.Array,
    weight_mask: jax.Array | None = None,
) -> jax.Array:
    r"""Causal scaled dot-product attention (Vaswani et al. 2017), softmax in float32.

    .. math::
       \mathrm{out}_i = \sum_{j:\ p^k_j \le p^q_i} a_{ij} v_j, \quad
       a_{i\cdot} = \mathrm{softmax}_j\big(q_i \cdot k_j / \sqrt{D}\big)

    Key ``j`` is visible to query ``i`` when its position is not later. The positions make one
    function serve both a whole sequence (queries and keys at ``0 .. T - 1``) and a decoding
    step against a :class:`KVCache`, whose unfilled slots lie at later positions. Every query
    must see at least one key (its own position).

    Args:
      q: ``[B, T_q, H, D]`` queries.
      k, v: ``[B, T_k, H, D]`` keys and values.
      query_positions: ``[T_q]`` integer positions.
      key_positions: ``[T_k]`` integer positions.
      weight_mask: optional ``[B, H, T_q, T_k]`` multiplier of the attention weights
        (attention dropout: keep factors 0 or ``1 / (1 - p)``).

    Returns:
      ``[B, T_q, H, D]`` float32.
    """
    if jnp.ndim(q) != 4 or jnp.shape(k) != jnp.shape(v) or jnp.ndim(k) != 4:
        raise ValueError(
            f"q must have shape [B, T_q, H, D] and k, v the same shape [B, T_k, H, D]; got "
            f"{jnp.shape(q)}, {jnp.shape(k)}, {jnp.shape(v)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {q.shape} and k {k.shape} must agree on B, H and D")
    if jnp.shape(query_positions) != (q.shape[1],) or jnp.shape(key_positions) != (k.shape[1],):
        raise ValueError(
            f"query_positions and key_positions must have shapes {(q.shape[1],)} and "
            f"{(k.shape[1],)}, got {jnp.shape(query_positions)} and {jnp.shape(key_positions)}"
        )
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(q.shape[-1])
    visible = key_positions[None, :] <= query_positions[:, None]
    weights = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    if weight_mask is not None:
        weights = weights * weight_mask
    return jnp.einsum(
        "bhqk,bkhd->bqhd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32
    )


# ----------------------------------------------------------------------------------------------
# Modules


def _normal(std: float) -> Any:
    return nnx.initializers.normal(stddev=std)


def _linear(
    in_features: int, out_features: int, *, std: float, rngs: nnx.Rngs, param_dtype: Any
) -> nnx.Linear:
    """A biased projection computed in ``param_dtype`` (float32 parameters: float32)."""
    return nnx.Linear(
        in_features,
        out_features,
        kernel_init=_normal(std),
        dtype=param_dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def _projection(
    in_features: int, out_features: int, *, rngs: nnx.Rngs, param_dtype: Any
) -> nnx.Linear:
    """A bias-free change of width drawn ``N(0, 1 / in_features)`` (scale-preserving)."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=False,
        kernel_init=_normal(1.0 / math.sqrt(in_features)),
        dtype=param_dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def _norm(kind: str, features: int, *, rngs: nnx.Rngs, param_dtype: Any) -> nnx.Module:
    """RMSNorm or LayerNorm, normalising in float32 whatever the parameters' dtype."""
    norm = nnx.RMSNorm if kind == "rmsnorm" else nnx.LayerNorm
    return norm(features, epsilon=1e-5, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)


def _apply(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Inverted dropout with precomputed keep factors (``None``: identity)."""
    return x if mask is None else x * mask


class Block(nnx.Module):
    """One pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``.

    Args:
      d_model: width ``d`` of the residual stream.
      num_heads: ``H``; ``d`` must be a multiple of it.
      d_ff: hidden width of the MLP.
      norm: ``"rmsnorm"`` or ``"layernorm"``.
      rope_base: RoPE's base, or ``None`` for no rotation (learned positions).
      residual_std: init scale of the two output projections.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        *,
        norm: str,
        rope_base: float | None,
        residual_std: float,
        rngs: nnx.Rngs,
        param_dtype: Any,
    ):
        self.num_heads, self.rope_base = num_heads, rope_base
        dtype = {"param_dtype": param_dtype, "rngs": rngs}
        self.attention_norm = _norm(norm, d_model, **dtype)
        self.qkv = _linear(d_model, 3 * d_model, std=INIT_STD, **dtype)
        self.attention_out = _linear(d_model, d_model, std=residual_std, **dtype)
        self.mlp_norm = _norm(norm, d_model, **dtype)
        self.mlp_in = _linear(d_model, d_ff, std=INIT_STD, **dtype)
        self.mlp_out = _linear(d_ff, d_model, std=residual_std, **dtype)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, jax.Array] | None = None,
        masks: tuple[jax.Array | None, jax.Array | None, jax.Array | None] = (None,) * 3,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``x [B, T, d]`` float32 at consecutive ``positions [T]`` -> ``[B, T, d]`` float32.

        Args:
          cache: this layer's keys and values ``[B, S, H, D_h]``; this step's are written at
            ``positions`` and the queries attend to the whole cache (later slots are masked).
            ``None``: the queries attend to this window's own keys.
          masks: dropout keep factors (attention weights ``[B, H, T, T_k]``, attention output
            ``[B, T, d]``, MLP output ``[B, T, d]``), ``None`` where off.

        Returns:
          The block's output and the updated cache (``None`` without one).
        """
        attention_mask, attention_out_mask, mlp_out_mask = masks
        batch, steps = x.shape[:2]
        qkv = self.qkv(self.attention_norm(x)).reshape(batch, steps, 3, self.num_heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.rope_base is not None:
            q = rotary_embedding(q, positions, self.rope_base)
            k = rotary_embedding(k, positions, self.rope_base)
        key_positions = positions
        if cache is not None:
            start = (0, positions[0], 0, 0)
            cache = tuple(
                jax.lax.dynamic_update_slice(old, new.astype(old.dtype), start)
                for old, new in zip(cache, (k, v), strict=True)
            )
            k, v = cache
            key_positions = jnp.arange(k.shape[1], dtype=positions.dtype)
        attended = causal_attention(q, k, v, positions, key_positions, attention_mask)
        out = self.attention_out(attended.reshape(batch, steps, -1)).astype(jnp.float32)
        x = x + _apply(out, attention_out_mask)
        hidden = jax.nn.gelu(self.mlp_in(self.mlp_norm(x)))
        out = self.mlp_out(hidden).astype(jnp.float32)
        return x + _apply(out, mlp_out_mask), cache


class Transformer(nnx.Module):
    """GPT-style decoder-only Transformer LM with any output head (Radford et al. 2019).

    Tokens are batch-major: ``tokens [B, T]`` (the AWD-LSTM is time-major, ``[T, B]``). Each
    window is processed from scratch (no state crosses windows), with every position predicting
    the next token. The head gets the final-normed ``d_model``-wide features; a mixture head
    ("mos", "moss", "mos_plif") gets ``latent_features = d_model`` so that its decoder can be
    tied to the embedding, as in :class:`~bottleneck.nn.AWDLSTM`.

    ``head_features = d`` puts the head at its own width ``d`` (the bottleneck) with the trunk
    unchanged: the final-normed features pass through a learned projection
    ``h = P_out x`` (``d_model -> d``, no bias) into the head, so a softmax head's
    log-probabilities have rank ``<= d + 1`` whatever ``d_model`` is. With tied weights the token
    embedding is factorized as in ALBERT (Lan et al. 2020): a table ``E [M, d]``, shared with the
    head's decoder, and a projection ``P_in`` (``d -> d_model``, no bias) into the residual stream,
    so that the one table is both the input embedding and the ``d``-wide decoder (also at
    ``d = d_model``, so that every ``d`` has the same structure). Both projections
    are drawn ``N(0, 1 / fan_in)``, which keeps the scale of the unfactorized model: the embedded
    tokens keep the table's ``N(0, 0.02^2)`` entries in expectation, and ``h`` has the RMS of the
    normed features. Every cell of a study over ``d`` then shares the same trunk, and differs only
    in ``d`` and the projections' sizes.

    That factorized table sizes the input embedding by ``d`` too, so the trunk's input (and the
    parameter count) changes with ``d``. ``embedding_features = e`` fixes it instead: the table
    is ``E [M, e]`` at every ``d`` (projected to ``d_model`` by ``P_in`` unless ``e = d_model``,
    where it enters the residual stream as in the unfactorized model), and with tied weights the
    head decodes with ``W = E Q`` (:class:`~bottleneck.nn.heads.ProjectedEmbedding`), ``Q`` a
    learned ``[e, d]`` map. Everything but ``P_out``, ``Q`` and the head's own parameters is then
    the same at every ``d``; weight tying (a strong regularizer on small corpora, Press & Wolf
    2017) is kept, and a softmax head's logits ``W h + b = E (Q h) + b`` still have rank
    ``<= d + 1``. ``Q`` is drawn ``N(0, 1 / e)``, so the decoder's entries start with the table's
    ``N(0, 0.02^2)`` scale in expectation, the scale of today's tied decoders (the factorized
    ``d``-wide table and the unfactorized one alike). The alternatives change more than the
    bottleneck: an untied decoder ``[M, d]`` gives up tying, and ``W = E`` at ``e = d`` is the
    factorized model.

    Args:
      vocab_size: ``M``.
      d_model: width of the residual stream (and of the embedding and the head's input unless
        ``head_features`` is given).
      num_layers: ``L`` blocks.
      num_heads: attention heads; must divide ``d_model`` (with RoPE, ``d_model / num_heads``
        must be even).
      d_ff: MLP hidden width; default ``4 * d_model``.
      max_len: the longest window (and decoding context) the model accepts; the size of the
        learned position table.
      position_encoding: ``"rope"`` (rotary, Su et al. 2021) or ``"learned"`` (GPT-2's table).
      norm: ``"rmsnorm"`` or ``"layernorm"`` (pre-norm in every block, and a final norm).
      embedding_dropout: dropout on the summed input embeddings.
      residual_dropout: dropout on each block's attention and MLP outputs before they are
        added to the residual stream.
      attention_dropout: dropout on the attention weights.
      rope_base: RoPE's base (10,000).
      head: a name in :data:`bottleneck.nn.HEAD_NAMES` (with ``head_options``), or a factory
        ``(d_model, vocab_size, *, rngs, tied_embedding=...) -> nn.OutputHead`` for any
        composition, e.g. ``lambda d, m, **kw: nn.OutputHead(d, m, normalizer="sigsoftmax",
        num_components=3, **kw)`` (``tied_embedding`` is passed when ``tie_weights``).
      tie_weights: share the token embedding with the head's decoder (Press & Wolf 2017).
      head_features: ``d``, the head's input width behind learned projections (see above);
        ``None``: the head reads the ``d_model``-wide features directly.
      embedding_features: ``e``, the input table's width whatever ``head_features`` is (see
        above); tied, the head decodes with ``E Q``. ``None``: the table is ``d_model`` wide, or
        ``d`` wide (factorized) with ``head_features`` and ``tie_weights``.
      param_dtype: dtype of the parameters; projections compute in it, while norms, attention
        softmax, the residual stream and the head's logits stay float32.
      rngs: NNX random streams (``params``) for the initialisation.
      head_options: passed to :func:`bottleneck.nn.make_head` (``num_components``,
        ``num_knots``, ...).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        d_ff: int | None = None,
        max_len: int = 256,
        position_encoding: str = "rope",
        norm: str = "rmsnorm",
        embedding_dropout: float = 0.1,
        residual_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        rope_base: float = 10_000.0,
        head: str | Callable[..., OutputHead] = "softmax",
        tie_weights: bool = True,
        head_features: int | None = None,
        embedding_features: int | None = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
        **head_options: Any,
    ):
        d_ff = 4 * d_model if d_ff is None else d_ff
        if head_features is not None and head_features < 1:
            raise ValueError(f"head_features must be >= 1 or None, got {head_features}")
        if embedding_features is not None and embedding_features < 1:
            raise ValueError(f"embedding_features must be >= 1 or None, got {embedding_features}")
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("d_ff", d_ff),
            ("max_len", max_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if d_model % num_heads:
            raise ValueError(f"num_heads must divide d_model, got {num_heads} and {d_model}")
        if position_encoding not in POSITION_ENCODINGS:
            raise ValueError(
                f"position_encoding must be one of {POSITION_ENCODINGS}, got {position_encoding!r}"
            )
        if position_encoding == "rope" and (d_model // num_heads) % 2:
            raise ValueError(
                f"rope needs an even head size d_model / num_heads, got {d_model} / {num_heads}"
            )
        if not (math.isfinite(rope_base) and rope_base > 1):
            raise ValueError(f"rope_base must be a finite number > 1, got {rope_base}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        rates = {
            "embedding_dropout": embedding_dropout,
            "residual_dropout": residual_dropout,
            "attention_dropout": attention_dropout,
        }
        for name, rate in rates.items():
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {rate}")
        self.vocab_size, self.d_model, self.num_layers = vocab_size, d_model, num_layers
        self.num_heads, self.max_len, self.param_dtype = num_heads, max_len, param_dtype
        self.position_encoding = position_encoding
        self.embedding_dropout = embedding_dropout
        self.residual_dropout = residual_dropout
        self.attention_dropout = attention_dropout
        dtype = {"param_dtype": param_dtype, "rngs": rngs}
        head_width = d_model if head_features is None else head_features
        # The table: e wide at every d (the trunk does not change with d), d wide when tied at
        # head_features without it (factorized: P_in at every d), else d_model wide.
        factorized = embedding_features is None and head_features is not None and tie_weights
        if embedding_features is not None:
            embedding_width = embedding_features
        else:
            embedding_width = head_width if factorized else d_model
        projected_input = factorized or embedding_width != d_model  # P_in: table -> d_model
        # On a vocabulary-parallel mesh the table has the head's padded rows (zeros, never read).
        self.embedding = nnx.Embed(
            padded_vocab_size(vocab_size),
            embedding_width,
            embedding_init=padded_rows_init(_normal(INIT_STD), vocab_size),
            **dtype,
        )
        self.embedding_projection = (
            _projection(embedding_width, d_model, **dtype) if projected_input else None
        )
        self.head_projection = (
            None if head_features is None else _projection(d_model, head_features, **dtype)
        )
        self.position_embedding = (
            nnx.Embed(max_len, d_model, embedding_init=_normal(INIT_STD), **dtype)
            if position_encoding == "learned"
            else None
        )
        self.blocks = nnx.List(
            [
                Block(
                    d_model,
                    num_heads,
                    d_ff,
                    norm=norm,
                    rope_base=rope_base if position_encoding == "rope" else None,
                    residual_std=INIT_STD / math.sqrt(2 * num_layers),
                    **dtype,
                )
                for _ in range(num_layers)
            ]
        )
        self.final_norm = _norm(norm, d_model, **dtype)
        tied: dict[str, Any] = {}
        if tie_weights and embedding_features is None:
            tied = {"tied_embedding": self.embedding}
        elif tie_weights:  # the decoder is E Q, Q [e, the decoder's width]
            width = head_width
            if not callable(head) and is_mixture_preset(head):
                width = head_options.get("latent_features", head_width)
            tied = {"tied_embedding": ProjectedEmbedding(self.embedding, width, **dtype)}
        if callable(head):  # a composition of the user's
            if head_options:
                raise ValueError(
                    f"head_options {sorted(head_options)} apply to preset names; a head factory "
                    "takes its own options"
                )
            self.head = head(head_width, vocab_size, rngs=rngs, **tied)
            if not isinstance(self.head, OutputHead):
                raise ValueError(f"head factory must return an nn.OutputHead, got {self.head!r}")
        else:
            if is_mixture_preset(head):
                head_options = {"latent_features": head_width, **head_options}
            self.head = make_head(
                head, head_width, vocab_size, rngs=rngs, param_dtype=param_dtype, **tied,
                **head_options,
            )  # fmt: skip

    # -- the forward pass ----------------------------------------------------------------------

    def _check_tokens(self, tokens: jax.Array, room: int, what: str) -> None:
        if jnp.ndim(tokens) != 2 or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape [B, T] with T >= 1, got {jnp.shape(tokens)}")
        if tokens.shape[1] > room:
            raise ValueError(f"tokens has {tokens.shape[1]} steps, more than {what} ({room})")

    def _layer_masks(
        self, key: jax.Array | None, layer: int, batch: int, steps: int
    ) -> tuple[jax.Array | None, ...]:
        """Block ``layer``'s dropout masks, from one draw of ``fold_in(key, layer + 1)``.

        One draw per layer rather than per model: the attention masks ``[B, H, T, T]`` of all
        layers at once would be the largest buffer of the step.
        """
        if key is None:
            return (None, None, None)
        residual = ((batch, steps, self.d_model), self.residual_dropout)
        attention = ((batch, self.num_heads, steps, steps), self.attention_dropout)
        specs = [attention, residual, residual]
        return tuple(inverted_dropout_masks(jax.random.fold_in(key, layer + 1), specs))

    def _forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None,
        key: jax.Array | None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final-normed features ``[B, T, d]`` (float32) of ``tokens`` at ``positions``.

        Dropout (``key``) is for training windows; decoding with a ``cache`` passes none.
        """
        batch, steps = tokens.shape
        x = jnp.take(self.embedding.embedding[...], tokens, axis=0)
        if self.embedding_projection is not None:
            x = self.embedding_projection(x)
        x = x.astype(jnp.float32)
        if self.position_embedding is not None:
            table = self.position_embedding.embedding[...]
            x = x + jnp.take(table, positions, axis=0).astype(jnp.float32)
        if key is not None:
            (mask,) = inverted_dropout_masks(
                jax.random.fold_in(key, 0), [((batch, steps, self.d_model), self.embedding_dropout)]
            )
            x = _apply(x, mask)
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else (cache.keys[i], cache.values[i])
            masks = self._layer_masks(key, i, batch, steps)
            x, layer_cache = block(x, positions, layer_cache, masks)
            if layer_cache is not None:
                keys.append(layer_cache[0])
                values.append(layer_cache[1])
        x = self.final_norm(x)
        if cache is None:
            return x, None
        return x, KVCache(tuple(keys), tuple(values), cache.length + steps)

    def features(self, tokens: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """The head's input: final-normed features ``[B, T, d_model]`` (float32) of a window.

        Args:
          tokens: integer ids ``[B, T]``, ``1 <= T <= max_len``; position ``t`` sees
            ``tokens[:, :t + 1]`` only.
          key: PRNG key for dropout; ``None`` is deterministic (evaluation).
        """
        self._check_tokens(tokens, self.max_len, "max_len")
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return self._forward(tokens, positions, None, key)[0]

    def head_input(self, features: jax.Array) -> jax.Array:
        """The head's input ``[..., d]``: the features, projected to ``head_features`` if set."""
        features = features.astype(self.param_dtype)
        if self.head_projection is not None:
            features = self.head_projection(features)
        return features

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Deterministic log-probabilities ``[B, T, M]`` of the next token at every position."""
        return self.head(self.head_input(self.features(tokens)))

    def nll(
        self, features: jax.Array, targets: jax.Array, where: jax.Array | None = None
    ) -> jax.Array:
        """The head's mean NLL (chunked, memory-bounded) of ``targets [B, T]``.

        Args:
          features: ``[B, T, d_model]`` from :meth:`features`.
          targets: ``[B, T]`` next-token ids.
          where: optional ``[B, T]`` mask of the positions that count.
        """
        return self.head.loss(self.head_input(features), targets, where)

    def objective(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        *,
        key: jax.Array | None = None,
        where: jax.Array | None = None,
    ) -> tuple[jax.Array, TransformerAux]:
        """The training loss of one window: the mean NLL of ``targets`` (memory-bounded).

        Args:
          tokens, targets: ``[B, T]`` ids; ``targets[:, t]`` is the token after
            ``tokens[:, t]``.
          key: PRNG key for dropout; ``None`` evaluates deterministically.
          where: optional ``[B, T]`` mask of the positions that count (e.g. a padded window's
            real steps; causality keeps padding at the end from affecting them).

        Returns:
          The loss and :class:`TransformerAux` (the NLL alone, equal to the loss here).
        """
        if jnp.shape(targets) != jnp.shape(tokens):
            raise ValueError(
                f"targets must have the shape of tokens {jnp.shape(tokens)}, got {jnp.shape(targets)}"
            )
        nll = self.nll(self.features(tokens, key=key), targets, where)
        return nll, TransformerAux(nll)

    # -- incremental decoding ------------------------------------------------------------------

    def init_decode_state(self, batch_size: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` positions.

        ``max_len`` may not exceed the model's own ``max_len``. The cache holds
        ``2 L B max_len d_model`` numbers in the projections' dtype.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_len <= self.max_len:
            raise ValueError(
                f"max_len must be in [1, {self.max_len}] (the model's max_len), got {max_len}"
            )
        head_dim = self.d_model // self.num_heads
        shape = (batch_size, max_len, self.num_heads, head_dim)
        empty = tuple(jnp.zeros(shape, self.param_dtype) for _ in range(self.num_layers))
        return KVCache(empty, empty, jnp.zeros((), jnp.int32))

    def _extend(self, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
        """Log-probs ``[B, M]`` of the token after the last of ``tokens [B, T]``; the cache."""
        capacity = cache.keys[0].shape[1]
        self._check_tokens(tokens, capacity, "the cache's capacity")
        if tokens.shape[0] != cache.keys[0].shape[0]:
            raise ValueError(
                f"tokens has batch {tokens.shape[0]}, the cache {cache.keys[0].shape[0]}"
            )
        positions = cache.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        features, cache = self._forward(tokens, positions, cache, None)
        log_probs = self.head(self.head_input(features[:, -1]))
        # A traced length can overflow the cache, where dynamic_update_slice would silently
        # overwrite the last slots: the result is NaN instead.
        return jnp.where(cache.length <= capacity, log_probs, jnp.nan), cache

    def prefill(self, state: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
        """Feeds a prompt ``tokens [B, P]`` in one pass (no dropout).

        Returns:
          The log-probabilities ``[B, M]`` of the token after the prompt and the cache with
          the prompt's ``P`` positions appended.
        """
        return self._extend(state, tokens)

    def decode_step(self, state: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
        """Feeds one token per sequence, ``tokens [B]``: the next log-probs ``[B, M]``, the cache."""
        if jnp.ndim(tokens) != 1:
            raise ValueError(f"tokens must have shape [B], got {jnp.shape(tokens)}")
        return self._extend(state, tokens[:, None])


class TransformerLanguageModel(nnx.Module):
    """A :class:`Transformer` behind the training loop's model interface
    (:class:`bottleneck.train.lm.LanguageModel`), as :class:`~bottleneck.nn.awd_lstm.
    AWDLSTMLanguageModel` is the AWD-LSTM's.

    Stateless: the carry is ``None`` and every window ``tokens [B, T]`` is attended from its own
    first step (a position sees at most its window's earlier tokens). A window is padded after
    its ``length`` real steps; the padded positions are left out of the loss by ``where`` and,
    lying after the real ones, cannot change them (causal attention). The objective is the NLL
    alone (dropout inside the model; no AR / TAR).

    Args:
      model: the Transformer (its parameters are this module's); windows may be at most its
        ``max_len`` steps long.
    """

    def __init__(self, model: Transformer):
        self.model = model

    def initial_carry(self, batch_size: int) -> None:
        del batch_size
        return None

    def objective(
        self, tokens: jax.Array, targets: jax.Array, carry: None, *, key: jax.Array, length: Any
    ) -> tuple[jax.Array, StatelessAux]:
        """Mean NLL of the real positions of ``targets [B, T]`` with dropout from ``key``."""
        del carry
        loss, aux = self.model.objective(tokens, targets, key=key, where=_real(tokens, length))
        return loss, StatelessAux(aux.nll)

    def nll(
        self, tokens: jax.Array, targets: jax.Array, carry: None, *, length: Any
    ) -> tuple[jax.Array, None]:
        """Deterministic mean NLL of the real positions of ``targets [B, T]``; no carry."""
        del carry
        features = self.model.features(tokens)
        return self.model.nll(features, targets, _real(tokens, length)), None

    def log_probs(self, tokens: jax.Array, carry: None, *, length: Any) -> tuple[jax.Array, None]:
        """Deterministic log-probabilities ``[B, T, M]`` (padded positions too); no carry."""
        del carry, length  # padding comes after the real steps: causality leaves them as they are
        return self.model(tokens), None


def _real(tokens: jax.Array, length: Any) -> jax.Array:
    """``[B, T]`` booleans: the real (unpadded) steps ``t < length`` of a window."""
    return jnp.broadcast_to(time_mask(tokens.shape[1], length)[None, :], tokens.shape)
