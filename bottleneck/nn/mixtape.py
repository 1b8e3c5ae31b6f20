r"""Mixtape (Yang, Luong, Salakhutdinov & Le, NeurIPS 2019): one softmax over gated logits.

MoS mixes ``K`` softmaxes; Mixtape mixes the ``K`` components' *logits* per token and
normalizes once ("logit space vector gating", Sec. 3.1):

.. math::
   p(x \mid c) = \frac{\exp \bar z_x}{\sum_{x'} \exp \bar z_{x'}}, \qquad
   \bar z_x = \sum_{k=1}^{K} \pi_{c,x,k}\, h_{c,k}^\top w_x + b_x

with ``K`` context embeddings ``h_{c,k}`` (the head's latent slot; Yang et al.:
``tanh(H_k g_c)``) and token-specific gate priors ``pi_{c,x,k}`` from the pre-activations

.. math::
   l_{c,x,j} = v_x^\top \tanh(U_j g_c) + u_j^\top g_c + b_{x,j}

turned into weights by a sigmoid tree (Sec. 3.2, :func:`bottleneck.mixtures.sigmoid_tree_log_weights`,
``j = 1..K-1``) or, for ``K`` not a power of two, by a softmax over ``j = 1..K``. The gated
logits are not bounded to rank ``d + 1`` because ``pi`` depends on both ``c`` and ``x``.

Gate sharing (Sec. 3.3): the infrequent tokens share one gate, ``l_{c,*,j} = u_j^\top g_c +
b_{*,j}``, so their gated logits are a single product ``w_x^\top \sum_k \pi_{c,*,k} h_{c,k}``
(``[.., d'] x [d', M]``) and only the frequent tokens pay for ``K`` logits and their gates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bottleneck._checks import require_finite_number, require_int
from bottleneck.mixtures import (
    gated_logits,
    sigmoid_tree_gated_logits,
    sigmoid_tree_log_weights,
    sigmoid_tree_mix,
)
from bottleneck.nn.heads import (
    OutputHead,
    affine_logits,
    decoder_products,
    padded_rows_init,
    row_logits,
    uniform_init,
)
from bottleneck.sharding import VOCAB, VocabShard, axis_size, context_mesh, vocab_rows_metadata

GATES = ("sigmoid_tree", "softmax")
# Float32 buffers per component logit (K per token with its own gate) that a chunk keeps live at
# the peak of its value and gradient, beyond the gated logits' (the head's
# HEAD_BUFFERS_PER_LOGIT and the pieces' own), per gate. The sigmoid tree: the component logits
# and gate pre-activations, each its own [C, M] product, and the tree's saved sigmoids,
# differences and gradients, most of which XLA fuses. The softmax gate: the [C, K, M] logits and
# log weights, their gradients and the mixture's exponentials. Calibrated with
# compiled.memory_analysis() on XLA:CPU at d = 256, M = 32768, K = 4, where budgets of 0.25-1 GiB
# raise the temporaries by 0.6-0.9x the extra budget (XLA reuses more of a small chunk's
# buffers): tests/nn/test_heads.py and tests/nn/test_mixtape.py check 0.5-1.1x from 128 to
# 256 MiB for both gates, without gate sharing and with 10% frequent tokens.
MIXTAPE_BUFFERS_PER_LOGIT = {"sigmoid_tree": 1.6, "softmax": 6.5}


class MixtapeHead(OutputHead):
    r"""Mixtape: ``K`` context embeddings, token-specific gates, one softmax over gated logits.

    An :class:`OutputHead` (same ``head(h)``, ``head.loss``, ``head.label_log_probs``, latent
    slot, tied embedding, meshes) whose mixture mixes logits, not probabilities (see the
    module docstring for the equations, Yang et al. 2019, Sec. 3). A pointwise map and a
    normalizer, if given, act on the gated logits (Mixtape itself: none and softmax).

    Args:
      in_features, vocab_size, rngs: as :class:`OutputHead`.
      num_components: ``K`` (the paper: 4). ``K = 1`` is the plain head (no gates).
      gate: ``"sigmoid_tree"`` (the paper; ``K - 1`` sigmoids, ``K`` a power of two) or
        ``"softmax"`` (``K`` pre-activations normalized by a softmax, any ``K``). Default
        (``None``): the tree when ``K`` is a power of two, else the softmax (so a config's
        ``num_components=15`` works); asking for a tree with another ``K`` is a
        ``ValueError`` (it has no complete binary tree).
      gate_features: ``d_2``, width of ``tanh(U_j g)`` and of the token gate embeddings
        ``v_x`` (default ``max(1, d // 4)``, our choice: a gate costs ``d_2 / d'`` of a
        component's logits per token and gate).
      token_counts: ``[M]`` training unigram counts, indexed by token id (ids here are in
        first-occurrence order, not by frequency, so the head cannot guess them), e.g.
        ``np.bincount(train_ids, minlength=M)``. With ``shared_gate_below``: tokens whose
        count is below it share one gate. ``None`` (default): every token has its own gate.
      shared_gate_below: the count threshold (a number > 0); given with ``token_counts``.
      **options: :class:`OutputHead`'s (``latent``, ``latent_features``, ``tied_embedding``,
        ``use_bias``, ``memory_budget``, ``param_dtype``, ``pointwise``, ``normalizer``).

    Parameters: the decoder ``W`` and bias ``b`` as any head; ``latent`` (``H_k``);
    ``gate_projection`` (``U_j``, ``[d, G d_2]``), ``gate_context`` (``u_j``, ``[d, G]``);
    ``gate_embedding`` (``v_x``, ``[M, d_2]``) and ``gate_bias`` (``b_{x,j}``, ``[M, G]``)
    stored with the decoder's padded rows and split on ``vocab`` like it (with gate sharing
    the rows of infrequent tokens are kept but unused: zero gradient); with gate sharing
    ``shared_gate_bias`` (``b_{*,j}``, ``[G]``). ``G = K - 1`` (tree) or ``K`` (softmax).

    Memory: a chunk holds ``[C, K, M]`` component logits (with gate sharing ``[C, M]`` shared
    logits and ``[C, K, F]`` for the ``F`` frequent tokens) and as many gate values;
    :attr:`elements_per_token` counts the logits, :attr:`declared_buffers_per_element` the
    buffers each costs.

    Example:
      >>> import numpy as np
      >>> from flax import nnx
      >>> from bottleneck import nn
      >>> counts = np.arange(100)[::-1]  # token 0 most frequent
      >>> head = nn.MixtapeHead(8, 100, rngs=nnx.Rngs(0), num_components=4,
      ...                       token_counts=counts, shared_gate_below=50)
      >>> head(jnp.ones((2, 8))).shape
      (2, 100)
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
        num_components: int = 4,
        gate: str | None = None,
        gate_features: int | None = None,
        token_counts: Sequence[float] | np.ndarray | jax.Array | None = None,
        shared_gate_below: float | None = None,
        **options: Any,
    ):
        num_components = require_int("num_components", num_components, 1)
        power_of_two = not num_components & (num_components - 1)
        if gate is None:
            gate = "sigmoid_tree" if power_of_two else "softmax"
        if gate not in GATES:
            raise ValueError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
        if gate == "sigmoid_tree" and not power_of_two:
            raise ValueError(
                f"gate='sigmoid_tree' needs num_components a power of two (a complete binary "
                f"tree of K - 1 sigmoids), got {num_components}; use gate='softmax' for any K"
            )
        self.gate = gate
        self.gate_features = (
            max(1, in_features // 4)
            if gate_features is None
            else require_int("gate_features", gate_features, 1)
        )
        self.num_gates = num_components - 1 if gate == "sigmoid_tree" else num_components
        self.frequent_rows = _frequent_rows(token_counts, shared_gate_below, vocab_size)
        super().__init__(
            in_features, vocab_size, rngs=rngs, num_components=num_components, **options
        )

    def _init_mixing(self, rngs: nnx.Rngs, param_dtype: Any) -> None:
        """The gates' parameters (a Mixtape head has no context-only prior ``w_pi``)."""
        d, d2, g = self.in_features, self.gate_features, self.num_gates
        rows = self.decoder.shape[0]
        linear = lambda width: nnx.Linear(  # noqa: E731
            d, width, use_bias=False, rngs=rngs, param_dtype=param_dtype
        )
        self.gate_projection = linear(g * d2)
        self.gate_context = linear(g)
        self.gate_embedding = nnx.Param(
            padded_rows_init(uniform_init(0.1), self.vocab_size)(
                rngs.params(), (rows, d2), param_dtype
            ),
            **vocab_rows_metadata(2),
        )
        self.gate_bias = nnx.Param(jnp.zeros((rows, g), param_dtype), **vocab_rows_metadata(2))
        if self.shares_gates:
            self.shared_gate_bias = nnx.Param(jnp.zeros((g,), param_dtype))

    @property
    def shares_gates(self) -> bool:
        """Whether infrequent tokens share one gate (``token_counts`` were given)."""
        return self.frequent_rows is not None

    @property
    def num_frequent_columns(self) -> int:
        """Columns that get their own gate, over all shards (padding included)."""
        if self.frequent_rows is None:
            return self.vocab_size
        return len(self.frequent_rows) * len(self.frequent_rows[0])

    @property
    def elements_per_token(self) -> int:
        """``K M``, or with gate sharing ``M + K F`` (``F`` frequent tokens, padded per shard)."""
        if not self.is_mixture or not self.shares_gates:
            return self.num_components * self.vocab_size
        return self.vocab_size + self.num_components * self.num_frequent_columns

    @property
    def declared_buffers_per_element(self) -> float | None:
        """Per element of :attr:`elements_per_token`: ``(b M + c K F) / elements``.

        ``b``: the head's and its pieces' buffers per gated logit (``M`` per token), ``c``
        (:data:`MIXTAPE_BUFFERS_PER_LOGIT` of the gate) per component logit of a token with its
        own gate (``F = M`` without gate sharing).
        """
        declared = super().declared_buffers_per_element
        if declared is None or not self.is_mixture:
            return declared
        component_logits = self.num_components * self.num_frequent_columns
        per_logit = MIXTAPE_BUFFERS_PER_LOGIT[self.gate]
        total = declared * self.vocab_size + per_logit * component_logits
        return total / self.elements_per_token

    def log_prior(self, h: jax.Array) -> None:
        """No context-only prior: Mixtape's gates depend on the token too.

        See :meth:`gate_pre_activations`.
        """
        return None

    def log_gates(self, pre_activations: jax.Array) -> jax.Array:
        """Gate pre-activations ``[..., G, M]`` -> log gate priors ``log pi`` ``[..., K, M]``."""
        if self.gate == "softmax":
            return jax.nn.log_softmax(pre_activations.astype(jnp.float32), axis=-2)
        return sigmoid_tree_log_weights(pre_activations, axis=-2)

    def gate_pre_activations(
        self, h: jax.Array, columns: jax.Array | None = None, *, reverse_only: bool = False
    ) -> jax.Array:
        """Gate pre-activations ``[..., G, M_local]`` of this device's columns (or ``columns``).

        ``l_{x,j} = v_x^T tanh(U_j g) + u_j^T g + b_{x,j}`` for ``g = h``, in float32;
        :meth:`log_gates` turns them into log gate priors. ``columns`` (local row indices,
        out-of-range ones read as zero rows) picks the frequent tokens. ``reverse_only``: see
        :func:`~bottleneck.nn.heads.decoder_products` (the G products).
        """
        embedding, bias = self.gate_embedding[...], self.gate_bias[...]
        if columns is not None:
            embedding = jnp.take(embedding, columns, axis=0, mode="fill", fill_value=0)
            bias = jnp.take(bias, columns, axis=0, mode="fill", fill_value=0)
        return self._pre_activations(h, embedding, bias, reverse_only=reverse_only)

    def _pre_activations(
        self, h: jax.Array, embedding: jax.Array, bias: jax.Array, *, reverse_only: bool = False
    ) -> jax.Array:
        """:meth:`gate_pre_activations` of the columns whose gate rows are ``embedding [n, d_2]``
        and ``bias [n, G]``; ``reverse_only``: see :func:`~bottleneck.nn.heads.decoder_products`."""
        lead, g = h.shape[:-1], self.num_gates
        projected = jnp.tanh(self.gate_projection(h))
        projected = projected.reshape(*lead, g, self.gate_features)
        context = self.gate_context(h).astype(projected.dtype)[..., None]  # [..., G, 1]
        # One product with the context term and the bias folded in (a column of ones against
        # u_j^T g, an identity picking b_{x,j}): the [..., G, M] pre-activations are written
        # once, not added to twice, and the sums of their gradient over tokens (for b) and
        # words (for u_j) come out of the product's transposes; 1.3-1.6x faster loss at d = 32.
        selector = jnp.broadcast_to(jnp.eye(g, dtype=projected.dtype), (*lead, g, g))
        left = jnp.concatenate([projected, context, selector], axis=-1)
        ones = jnp.ones((embedding.shape[0], 1), embedding.dtype)
        right = jnp.concatenate([embedding, ones, bias.astype(embedding.dtype)], axis=-1)
        # A product per gate, stacked: the sigmoid tree reads each gate's [..., M] back as the
        # product's own output (see gated).
        products = decoder_products(jnp.unstack(left, axis=-2), right, reverse_only=reverse_only)
        return jnp.stack(products, axis=-2)

    def label_gate_pre_activations(
        self, h: jax.Array, rows: jax.Array, tables: GateTables | None = None
    ) -> jax.Array:
        """Gate pre-activations ``[..., G]`` of one column per token (local ``rows`` ``[...]``).

        :meth:`gate_pre_activations` for each token's own column only: ``[..., d_2]`` rows of
        the gate embedding, not a ``[..., G, M]`` array. With ``tables`` (:meth:`loss_tables`)
        ``rows`` index its frequent tokens' gate rows instead.
        """
        lead, g = h.shape[:-1], self.num_gates
        embedding, bias = self.gate_embedding[...], self.gate_bias[...]
        if tables is not None:
            embedding, bias = tables.gate_embedding, tables.gate_bias
        take = lambda x: jnp.take(x, rows, axis=0)  # noqa: E731
        projected = jnp.tanh(self.gate_projection(h)).reshape(*lead, g, self.gate_features)
        pre = jnp.einsum(
            "...gd,...d->...g", projected, take(embedding), preferred_element_type=jnp.float32
        )
        bias = take(bias).astype(jnp.float32)
        return pre + self.gate_context(h).astype(jnp.float32) + bias

    def shared_gate_pre_activations(self, h: jax.Array) -> jax.Array:
        """The shared gate's pre-activations ``l_{*,j} = u_j^T g + b_{*,j}`` ``[..., G]``."""
        return self.gate_context(h).astype(jnp.float32) + self.shared_gate_bias[...]

    @property
    def has_loss_tables(self) -> bool:
        """A gate-sharing mixture's loss reads its rows from :meth:`loss_tables`."""
        return self.is_mixture and self.shares_gates

    def loss_tables(self, vocab: VocabShard) -> GateTables | None:
        """With gate sharing, the rows the loss reads, gathered once per call (not per chunk).

        The decoder's rows (and bias) in the order frequent tokens then shared-gate tokens,
        so that each block of :meth:`score_blocks` is a slice, and the frequent tokens' gate
        rows; the gradients reach the parameters through one scatter per call.
        """
        if not self.has_loss_tables:
            return None
        return self._tables(self._gate_columns(vocab, self.decoder.shape[0]))

    def _tables(self, columns: GateColumns) -> GateTables:
        """:meth:`loss_tables` of this device's ``columns``."""
        order = jnp.concatenate([columns.frequent, columns.shared])
        take = lambda x, rows: jnp.take(x, rows, axis=0, mode="fill", fill_value=0)  # noqa: E731
        return GateTables(
            decoder=take(self.decoder[...], order),
            bias=None if self.bias is None else take(self.bias[...], order),
            gate_embedding=take(self.gate_embedding[...], columns.frequent),
            gate_bias=take(self.gate_bias[...], columns.frequent),
        )

    def score_blocks(
        self,
        h: jax.Array,
        labels: jax.Array,
        latent_mask: jax.Array | None = None,
        *,
        vocab: VocabShard,
        reverse_only: bool = False,
        tables: GateTables | None = None,
    ) -> tuple[jax.Array, list[jax.Array], None]:
        r"""The labels' gated log-scores ``[..., 1]`` and every column's, in blocks ``[..., 1, M_b]``.

        Without gate sharing every column's gated logit is written, and the label's is picked
        from them. With gate sharing the label's comes from its own rows (decoder, gate
        embedding, gate bias), and the columns come in two blocks that are never put together into
        ``[..., M]``: the frequent tokens' own gated logits ``[..., F]`` and the shared-gate
        tokens' single product ``(\sum_k \pi_{*,k} h_k)^T w_x + b_x`` ``[..., M - F]``, every
        row read from ``tables`` (:meth:`loss_tables`; gathered here when not given).
        """
        if not self.is_mixture:
            return super().score_blocks(
                h, labels, latent_mask, vocab=vocab, reverse_only=reverse_only
            )
        latents, _ = self.components(h, latent_mask)  # [..., K, d']
        rows, in_shard = vocab.local_labels(labels, self.decoder.shape[0])
        if not self.shares_gates:
            # Every column's gated logit is written anyway: the label's is picked from them.
            z = self.gated(
                latents,
                self.decoder[...],
                self.gate_pre_activations(h, reverse_only=reverse_only),
                reverse_only=reverse_only,
            )
            if self.bias is not None:
                z = z + self.bias[...].astype(jnp.float32)
            scores = vocab.mask_padding(self.log_scores(z))
            label = jnp.take_along_axis(scores, rows[..., None], axis=-1)
            return jnp.where(in_shard[..., None], label, 0.0), [scores[..., None, :]], None
        columns = self._gate_columns(vocab, self.decoder.shape[0])
        tables = self._tables(columns) if tables is None else tables
        split = columns.frequent.shape[0]
        pre = self.shared_gate_pre_activations(h)
        if split:  # (every label shares the gate when no token has its own)
            pre = jnp.where(
                jnp.take(columns.own_gate, rows)[..., None],
                self.label_gate_pre_activations(
                    h, jnp.take(columns.frequent_position, rows), tables
                ),
                pre,
            )
        position = jnp.take(columns.position, rows)
        z = row_logits(latents, tables.decoder, position)
        z_label = self.mix(z[..., None], pre[..., None])[..., 0]
        if tables.bias is not None:
            z_label = z_label + jnp.take(tables.bias, position).astype(jnp.float32)
        label_scores = jnp.where(in_shard, self.log_scores(z_label), 0.0)[..., None]
        own = self.gated(
            latents,
            tables.decoder[:split],
            self._pre_activations(
                h, tables.gate_embedding, tables.gate_bias, reverse_only=reverse_only
            ),
            reverse_only=reverse_only,
        )
        if tables.bias is not None:
            own = own + tables.bias[:split].astype(jnp.float32)
        common = affine_logits(
            self.shared_mixture(h, latents),
            tables.decoder[split:],
            None if tables.bias is None else tables.bias[split:],
            reverse_only=reverse_only,
        )
        blocks = [
            _mask_columns(self.log_scores(own), columns.frequent_real),
            _mask_columns(self.log_scores(common), columns.shared_real),
        ]
        return label_scores, [block[..., None, :] for block in blocks], None

    def mixture_scores(
        self, h: jax.Array, latent_mask: jax.Array | None = None, *, vocab: VocabShard
    ) -> tuple[jax.Array, None]:
        r"""Log-scores ``[..., 1, M_local]`` of the gated logits; no prior (one softmax)."""
        if not self.is_mixture:
            return super().mixture_scores(h, latent_mask, vocab=vocab)
        latents, _ = self.components(h, latent_mask)  # [..., K, d']
        decoder = self.decoder[...]
        if not self.shares_gates:
            z = self.gated(latents, decoder, self.gate_pre_activations(h))
        else:
            z = self.shared_gate_logits(h, latents, decoder)
            frequent = self._gate_columns(vocab, decoder.shape[0]).frequent
            if frequent.size:
                rows = jnp.take(decoder, frequent, axis=0, mode="fill", fill_value=0)
                own = self.gated(latents, rows, self.gate_pre_activations(h, frequent))
                z = z.at[..., frequent].set(own, mode="drop")
        if self.bias is not None:
            z = z + self.bias[...].astype(jnp.float32)
        return vocab.mask_padding(self.log_scores(z))[..., None, :], None

    def mix(self, component_logits: jax.Array, pre_activations: jax.Array) -> jax.Array:
        """Gated logits ``[..., M]`` from ``[..., K, M]`` component logits and ``[..., G, M]`` gates.

        The sigmoid tree goes through
        :func:`~bottleneck.mixtures.sigmoid_tree_gated_logits` (fused: one sigmoid per gate);
        the softmax gate through its log weights and :func:`~bottleneck.mixtures.gated_logits`.
        """
        if self.gate == "sigmoid_tree":
            return sigmoid_tree_gated_logits(component_logits, pre_activations)
        return gated_logits(component_logits, self.log_gates(pre_activations))

    def gated(
        self,
        latents: jax.Array,
        decoder: jax.Array,
        pre_activations: jax.Array,
        *,
        reverse_only: bool = False,
    ) -> jax.Array:
        """``sum_k pi_{x,k} h_k^T w_x`` ``[..., M]`` from the gates' pre-activations.

        ``latents`` ``[..., K, d']``, ``decoder`` ``[M, d']``, ``pre_activations``
        ``[..., G, M]``; mixed by :meth:`mix`. ``reverse_only``: see
        :func:`~bottleneck.nn.heads.decoder_products` (the sigmoid tree's K products).
        """
        if self.gate == "sigmoid_tree":
            # A product per component and the gates as slices, each [..., M], never one
            # [..., K, M] array: on XLA:CPU the loss (value and gradients) runs 1.2-1.4x faster.
            z = decoder_products(jnp.unstack(latents, axis=-2), decoder, reverse_only=reverse_only)
            gates = jnp.unstack(pre_activations, axis=-2)
            return sigmoid_tree_mix(z, gates)
        z = jnp.einsum("...kd,md->...km", latents, decoder, preferred_element_type=jnp.float32)
        return self.mix(z, pre_activations)

    def shared_mixture(self, h: jax.Array, latents: jax.Array) -> jax.Array:
        """``sum_k pi_{*,k} h_k`` ``[..., d']``: the context the shared-gate tokens decode."""
        pre = self.shared_gate_pre_activations(h)
        weights = jnp.exp(self.log_gates(pre[..., None])[..., 0])  # [..., K]
        return jnp.einsum("...k,...kd->...d", weights.astype(latents.dtype), latents)

    def shared_gate_logits(self, h: jax.Array, latents: jax.Array, decoder: jax.Array) -> jax.Array:
        """``w_x^T sum_k pi_{*,k} h_k`` for every column: one ``[..., d'] x [d', M]`` product."""
        mixed = self.shared_mixture(h, latents)
        return jnp.einsum("...d,md->...m", mixed, decoder, preferred_element_type=jnp.float32)

    def _gate_columns(self, vocab: VocabShard, local_rows: int) -> GateColumns:
        """This device's frequent and shared-gate columns (local indices) and their masks."""
        table = np.asarray(self.frequent_rows, np.int32)  # [shards, F], local, padded
        shards = table.shape[0]
        if vocab.axis is not None and jax.lax.axis_size(vocab.axis) != shards:
            raise ValueError(
                f"this Mixtape head was built for {shards} vocabulary shard(s) but runs on "
                f"{jax.lax.axis_size(vocab.axis)}; build it inside the mesh it runs on"
            )
        per_shard = local_rows if vocab.axis is not None else local_rows // shards
        own = np.zeros((shards, per_shard + 1), bool)  # the last column catches the padding
        np.put_along_axis(own, np.minimum(table, per_shard), True, axis=1)
        own = own[:, :per_shard]
        real = np.arange(shards * per_shard).reshape(shards, per_shard) < self.vocab_size
        if vocab.axis is None:  # every row here: the global indices of all shards' tokens
            own, real = own.reshape(1, -1), real.reshape(1, -1)
        frequent = _padded_rows([np.flatnonzero(row) for row in own], own.shape[1])
        shared = _padded_rows(
            [np.flatnonzero(r & ~o) for r, o in zip(real, own, strict=True)], own.shape[1]
        )
        select = (lambda x: jnp.asarray(x[0])) if vocab.axis is None else (
            lambda x: jnp.asarray(x)[jax.lax.axis_index(vocab.axis)]
        )  # fmt: skip
        return GateColumns(
            frequent=select(frequent),
            frequent_real=None if vocab.axis is None else select(frequent < own.shape[1]),
            shared=select(shared),
            shared_real=None if vocab.axis is None else select(shared < own.shape[1]),
            own_gate=select(own),
            position=select(_positions(np.concatenate([frequent, shared], axis=1), own.shape[1])),
            frequent_position=select(_positions(frequent, own.shape[1])),
        )


class GateColumns(NamedTuple):
    """One device's columns under gate sharing: local indices, padded with an out-of-range row.

    ``*_real`` mark the entries that are columns (``None``: all are); ``own_gate`` ``[rows]``
    whether each local row has its own gate; ``position`` ``[rows]`` each row's place in
    ``frequent`` then ``shared`` (the order of :class:`GateTables`), ``frequent_position``
    ``[rows]`` its place in ``frequent`` (0 for a shared-gate row).
    """

    frequent: jax.Array
    frequent_real: jax.Array | None
    shared: jax.Array
    shared_real: jax.Array | None
    own_gate: jax.Array
    position: jax.Array
    frequent_position: jax.Array


class GateTables(NamedTuple):
    """The rows a gate-sharing loss reads (:meth:`MixtapeHead.loss_tables`), one device's.

    ``decoder`` ``[F + S, d']`` and ``bias`` ``[F + S]`` (``None``: no bias) in the order of
    the frequent then the shared-gate columns, ``gate_embedding`` ``[F, d_2]`` and
    ``gate_bias`` ``[F, G]`` of the frequent columns (padding: zero rows).
    """

    decoder: jax.Array
    bias: jax.Array | None
    gate_embedding: jax.Array
    gate_bias: jax.Array


def _positions(order: np.ndarray, rows: int) -> np.ndarray:
    """Per shard, each of ``rows`` local rows' index in its row of ``order`` ``[shards, n]``
    (entries ``>= rows`` are padding; a row absent from ``order`` gets 0)."""
    positions = np.zeros((order.shape[0], rows), np.int32)
    for shard, entries in enumerate(order):
        real = entries < rows
        positions[shard, entries[real]] = np.flatnonzero(real)
    return positions


def _padded_rows(rows: list[np.ndarray], fill: int) -> np.ndarray:
    """Index lists of unequal length as one ``[n, width]`` table, padded with ``fill``."""
    width = max(len(r) for r in rows)
    return np.stack([np.pad(r, (0, width - len(r)), constant_values=fill) for r in rows])


def _mask_columns(scores: jax.Array, real: jax.Array | None) -> jax.Array:
    """``scores [..., n]`` with the entries that are not columns (padding) at ``-inf``."""
    return scores if real is None else jnp.where(real, scores, -jnp.inf)


def _frequent_rows(
    token_counts: Any, shared_gate_below: float | None, vocab_size: int
) -> tuple[tuple[int, ...], ...] | None:
    """Per vocabulary shard, the local rows of tokens with ``count >= shared_gate_below``.

    Padded to one length with the shard's row count (an out-of-range index: dropped); ``None``
    without gate sharing. The shards are those of the context mesh's ``vocab`` axis.
    """
    if (token_counts is None) != (shared_gate_below is None):
        raise ValueError(
            "token_counts and shared_gate_below go together: tokens whose training count is "
            "below shared_gate_below share one gate; give both, or neither (no sharing)"
        )
    if token_counts is None:
        return None
    require_finite_number("shared_gate_below", shared_gate_below, positive=True)
    counts = np.asarray(token_counts)
    if counts.shape != (vocab_size,) or not np.issubdtype(counts.dtype, np.number):
        raise ValueError(
            f"token_counts must be numbers of shape [vocab_size] = ({vocab_size},), one count "
            f"per token id, got shape {counts.shape} and dtype {counts.dtype}"
        )
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError("token_counts must be finite and >= 0")
    shards = axis_size(context_mesh(), VOCAB)
    per_shard = -(-vocab_size // shards)
    frequent = np.zeros(per_shard * shards, bool)
    frequent[:vocab_size] = counts >= shared_gate_below
    local = [np.flatnonzero(block) for block in frequent.reshape(shards, per_shard)]
    width = max(len(rows) for rows in local)
    return tuple(tuple(int(i) for i in rows) + (per_shard,) * (width - len(rows)) for rows in local)
