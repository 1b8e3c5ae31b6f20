"""Output heads: hidden states ``[..., d]`` -> log-probabilities ``[..., M]`` (Flax NNX).

Every head is the same pipeline, ``logits (W h + b) -> pointwise map -> log-space normalizer
-> mixture (optional)``, and differs only in the pieces it overrides:

* :meth:`OutputHead.log_scores`, the elementwise ``log g`` of its normalizer (softmax: ``z``;
  sigsoftmax: ``z + log sigma(z)``; PLIF: ``plif(z)``; ...);
* :meth:`OutputHead.components`, the hidden vector(s) fed to the decoder and the mixture prior
  (one component and no prior, except for :class:`MixtureHead`).

``head(h)`` returns full log-probabilities; ``head.loss(h, labels, where)`` returns the mean
NLL through :func:`bottleneck.losses.chunked_cross_entropy`, which never holds the full
``[N, M]`` logits (nor ``[N, K, M]`` for a mixture). No head has a loss of its own.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bottleneck.losses import (
    DEFAULT_MEMORY_BUDGET,
    check_label_range,
    chunked_cross_entropy,
    target_log_probs,
)
from bottleneck.mixtures import mixture_log_probs
from bottleneck.monotone import monotone_mlp, monotone_mlp_init, plif, plif_init
from bottleneck.normalizers import (
    log_normalize,
    relu_log_scores,
    sigmoid_log_scores,
    sigsoftmax_log_scores,
    softmax_log_scores,
)
from bottleneck.sharding import DATA, VOCAB, axis_size, padded_vocab_size


def _require_int(name: str, value: Any, minimum: int, why: str = "") -> int:
    """``value`` as an ``int`` >= ``minimum``; ``ValueError`` naming the option otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}{why}, got {value!r}")
    return number


def _require_finite(name: str, value: Any, *, positive: bool) -> float:
    """``value`` as a finite float, > 0 (``positive``) or >= 0; ``ValueError`` naming it."""
    bound = "> 0" if positive else ">= 0"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}") from None
    if not math.isfinite(number) or not (number > 0 if positive else number >= 0):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def _check_plif_options(num_knots: Any, bound: Any, plif_noise: Any) -> tuple[int, float, float]:
    """PLIF options of a head, refused when degenerate (one knot, a non-finite bound, ...)."""
    num_knots = _require_int(
        "num_knots",
        num_knots,
        2,
        " (one knot makes the PLIF affine, f(z) = s z + c: a softmax with a learned "
        "temperature, not a nonlinear map)",
    )
    bound = _require_finite("bound", bound, positive=True)
    plif_noise = _require_finite("plif_noise", plif_noise, positive=False)
    return num_knots, bound, plif_noise


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


class OutputHead(nnx.Module):
    """Base output head: ``log_normalize(log_scores(W h + b))``; plain softmax as is.

    Args:
      in_features: ``d``, size of the hidden states fed to the decoder.
      vocab_size: ``M``.
      rngs: NNX random streams (``params``).
      tied_embedding: an ``nnx.Embed`` (or its ``[M, d]`` ``nnx.Param``) whose table is used
        as the decoder ``W`` (weight tying, Press & Wolf 2017; Merity et al.).
      use_bias: learn an output bias ``b`` ``[M]`` (zeros at init).
      memory_budget: bytes one chunk of :meth:`loss` may use.
      param_dtype: dtype of the parameters; logits and reductions are float32 regardless.
      mesh: a ``("data", "vocab")`` mesh (:func:`bottleneck.sharding.make_mesh`) to run
        :meth:`loss` data- and vocabulary-parallel: the decoder and bias are sharded on
        ``vocab`` (stored with :func:`~bottleneck.sharding.padded_vocab_size` rows, the extra
        ones masked out), tokens on ``data``. ``None``: one device.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
        tied_embedding: nnx.Embed | nnx.Param | None = None,
        use_bias: bool = True,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        param_dtype: Any = jnp.float32,
        mesh: Mesh | None = None,
    ):
        if in_features < 1 or vocab_size < 1:
            raise ValueError(
                f"in_features and vocab_size must be >= 1, got {in_features} and {vocab_size}"
            )
        _require_finite("memory_budget", memory_budget, positive=True)  # bytes
        self.in_features = in_features
        self.vocab_size = vocab_size
        self.memory_budget = memory_budget
        self.mesh = mesh
        rows = padded_vocab_size(vocab_size, mesh)
        sharded_rows = {"out_sharding": (VOCAB, None), "mesh": mesh} if self.vocab_parallel else {}
        if tied_embedding is None:
            self.decoder = nnx.Param(
                padded_rows_init(uniform_init(0.1), vocab_size)(
                    rngs.params(), (rows, self.decoder_features), param_dtype
                ),
                **sharded_rows,
            )
        else:
            table = (
                tied_embedding.embedding
                if isinstance(tied_embedding, nnx.Embed)
                else tied_embedding
            )
            if table.shape != (rows, self.decoder_features):
                raise ValueError(
                    f"tied_embedding must have shape [padded_vocab_size, {self.decoder_features}] "
                    f"= {(rows, self.decoder_features)}, got {table.shape}"
                )
            if self.vocab_parallel:  # the shared table lives vocab-sharded, like the decoder
                table.set_metadata(**sharded_rows)
                table.set_value(jax.device_put(table.get_value(), NamedSharding(mesh, P(VOCAB))))
            self.decoder = table
        sharded_bias = {"out_sharding": (VOCAB,), "mesh": mesh} if self.vocab_parallel else {}
        self.bias = nnx.Param(jnp.zeros((rows,), param_dtype), **sharded_bias) if use_bias else None

    @property
    def vocab_parallel(self) -> bool:
        """Whether the decoder is split over the mesh's ``vocab`` axis."""
        return axis_size(self.mesh, VOCAB) > 1

    @property
    def decoder_features(self) -> int:
        """Width of the vectors the decoder ``W`` multiplies (``d``; a mixture's latent size)."""
        return self.in_features

    @property
    def num_components(self) -> int:
        return 1

    @property
    def elements_per_token(self) -> int:
        """Size of one token's largest intermediate, for :meth:`loss`'s chunk sizing."""
        return self.num_components * self.vocab_size

    # Float32 buffers of [chunk, elements_per_token] live at the peak of one chunk's value and
    # gradient, measured with compiled.memory_analysis() on XLA:CPU (tests/nn/test_heads.py
    # checks that a chunk stays within memory_budget): softmax keeps the logits and their
    # gradient; normalizers with a log-sigmoid add one; PLIF's gather/scatter several.
    buffers_per_element: float = 2.0

    def logits(self, x: jax.Array) -> jax.Array:
        """``W x + b``: ``[..., decoder_features] -> [..., M]``, accumulated in float32."""
        z = jnp.einsum("...d,md->...m", x, self.decoder[...], preferred_element_type=jnp.float32)
        if self.bias is not None:
            z = z + self.bias[...].astype(jnp.float32)
        return z

    def log_scores(self, z: jax.Array) -> jax.Array:
        """The normalizer's elementwise ``log g(z)``; ``z`` for softmax."""
        return softmax_log_scores(z)

    def components(
        self, h: jax.Array, latent_mask: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """``h [..., d]`` -> decoder inputs ``[..., K, d']`` and log prior ``[..., K]`` (or None).

        ``latent_mask`` multiplies a mixture's latents (:class:`MixtureHead`); other heads have
        none and refuse it.
        """
        if latent_mask is not None:
            raise ValueError(
                f"latent_mask applies to mixture heads only; {type(self).__name__} has no latents"
            )
        return h[..., None, :], None

    @property
    def latent_mask_features(self) -> int:
        """Width of a per-token ``latent_mask`` (``K * d'``; 0: the head has no latents)."""
        return 0

    def _check_hidden(self, h: jax.Array) -> None:
        if jnp.ndim(h) < 1 or jnp.shape(h)[-1] != self.in_features:
            raise ValueError(f"h must have shape [..., {self.in_features}], got {jnp.shape(h)}")

    def _check_labels(self, labels: jax.Array) -> None:
        """Integer dtype, and concrete labels within ``[0, vocab_size)`` (at masked positions too).

        Traced labels cannot be read here; an out-of-range one makes :meth:`loss` NaN and its
        :meth:`label_log_probs` entry NaN instead (:func:`~bottleneck.losses.target_log_probs`
        and :func:`~bottleneck.losses.chunked_cross_entropy` check them in the computation,
        on every mesh; a label in a vocabulary's padding columns is out of range too).
        """
        check_label_range(labels, self.vocab_size)

    def _scores(self, inputs: jax.Array, first_column: jax.Array | int = 0) -> jax.Array:
        """``log_scores(W x + b)`` for this shard's columns, padding columns at ``-inf``."""
        scores = self.log_scores(self.logits(inputs))
        if padded_vocab_size(self.vocab_size, self.mesh) == self.vocab_size:
            return scores
        columns = first_column + jnp.arange(scores.shape[-1])
        return jnp.where(columns < self.vocab_size, scores, -jnp.inf)

    def __call__(self, h: jax.Array) -> jax.Array:
        """Full log-probabilities ``[..., M]`` for hidden states ``h [..., d]``."""
        self._check_hidden(h)
        inputs, log_prior = self.components(h)
        component_log_probs = log_normalize(self._scores(inputs))[..., : self.vocab_size]
        if log_prior is None:
            return component_log_probs[..., 0, :]
        return mixture_log_probs(component_log_probs, log_prior)

    def _per_token_latent_mask(self, h: jax.Array, latent_mask: jax.Array | None) -> Any:
        """``latent_mask`` broadcast to one row per token ``[..., K * d']`` (None stays None)."""
        if latent_mask is None:
            return None
        if not self.latent_mask_features:
            self.components(h, latent_mask)  # raises the head's own error
        shape = (*h.shape[:-1], self.latent_mask_features)
        try:
            return jnp.broadcast_to(latent_mask, shape).astype(h.dtype)
        except ValueError:
            raise ValueError(
                f"latent_mask must broadcast to {shape} (h {h.shape}), got {jnp.shape(latent_mask)}"
            ) from None

    def _state_specs(self, state: nnx.State) -> Any:
        """Partition specs of this head's state: decoder and bias on ``vocab``, the rest replicated."""

        def spec(path: tuple[Any, ...], leaf: jax.Array) -> P:
            owner = getattr(path[0], "key", None)
            if self.vocab_parallel and owner in ("decoder", "bias"):
                return P(VOCAB, *([None] * (leaf.ndim - 1)))
            return P()

        return jax.tree_util.tree_map_with_path(spec, state)

    def label_log_probs(
        self, h: jax.Array, labels: jax.Array, latent_mask: jax.Array | None = None
    ) -> jax.Array:
        """``log p(labels | h)`` ``[...]`` for ``h [..., d]``, without normalizing into ``[..., M]``.

        With a mesh it runs under ``shard_map`` (:meth:`_on_mesh`): tokens split on ``data``,
        decoder columns on ``vocab``, and :func:`~bottleneck.losses.target_log_probs` combines
        the shards. ``latent_mask``: see :meth:`loss`.

        Labels must lie in ``[0, M)``: a ``ValueError`` for concrete labels, NaN at the
        position of an out-of-range one under tracing (``jit``), never a plausible number.
        """
        self._check_hidden(h)
        self._check_labels(labels)
        constants = self._per_token_latent_mask(h, latent_mask)
        if self.mesh is None:
            return self._shard_label_log_probs(h, labels, None, constants)
        graphdef, state = nnx.split(self)
        vocab_axis = VOCAB if self.vocab_parallel else None

        def local(state, h, labels, where, constants):
            head = nnx.merge(graphdef, state)
            return head._shard_label_log_probs(h, labels, vocab_axis, constants)

        log_probs = self._on_mesh(local, state, h, labels, None, constants, out_specs=P(DATA))
        return log_probs[: labels.size].reshape(labels.shape)

    def _on_mesh(
        self,
        local: Callable[..., jax.Array],
        state: nnx.State,
        h: jax.Array,
        labels: jax.Array,
        where: jax.Array | None,
        constants: jax.Array | None,
        out_specs: P,
    ) -> jax.Array:
        """``local(state, h, labels, where, constants)`` under ``shard_map`` on this head's mesh.

        The tokens are flattened and padded to a multiple of the ``data`` axis (padding masked
        out in ``where``), and each device gets one contiguous block of them; the decoder and
        bias are split on ``vocab``, everything else replicated. Inputs ``[T, B]`` sharded on
        ``B`` should come batch-major (``[B, T]``) so that the flattening moves no data.
        """
        if jnp.shape(labels) != h.shape[:-1] or (
            where is not None and jnp.shape(where) != h.shape[:-1]
        ):
            raise ValueError(
                f"labels and where must have shape {h.shape[:-1]} (h {h.shape} without its "
                f"feature axis), got {jnp.shape(labels)} and {jnp.shape(where)}"
            )
        num_tokens, token_dims = labels.size, labels.ndim
        flat = lambda x: x.reshape(num_tokens, *x.shape[token_dims:])  # noqa: E731
        h, labels = flat(h), flat(labels)
        where = jnp.ones((num_tokens,), bool) if where is None else flat(jnp.asarray(where, bool))
        constants = None if constants is None else flat(constants)
        padding = -num_tokens % axis_size(self.mesh, DATA)
        if padding:
            pad = lambda x: jnp.pad(x, [(0, padding)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
            h, labels, where = pad(h), pad(labels), pad(where)
            constants = None if constants is None else pad(constants)
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(self._state_specs(state), P(DATA, None), P(DATA), P(DATA), P(DATA, None)),
            out_specs=out_specs,
        )(state, h, labels, where, constants)

    def _shard_label_log_probs(
        self,
        h: jax.Array,
        labels: jax.Array,
        vocab_axis: str | None,
        latent_mask: jax.Array | None = None,
    ) -> jax.Array:
        """``log p(labels | h)`` from this shard's decoder columns, split over ``vocab_axis``."""
        inputs, log_prior = self.components(h, latent_mask)
        first_column = 0
        if vocab_axis is not None:
            first_column = jax.lax.axis_index(vocab_axis) * self.decoder.shape[0]
        scores = self._scores(inputs, first_column)
        per_component = target_log_probs(
            scores,
            jnp.broadcast_to(labels[..., None], scores.shape[:-1]),
            vocab_axis=vocab_axis,
            vocab_offset=first_column,
            vocab_size=self.vocab_size,
        )
        if log_prior is None:
            return per_component[..., 0]
        joint = per_component + log_prior.astype(jnp.float32)
        return jax.nn.logsumexp(joint, axis=-1)

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
        included, while peak memory stays within ``memory_budget`` per chunk. With a mesh the
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
        self._check_labels(labels)
        constants = self._per_token_latent_mask(h, latent_mask)
        graphdef, state = nnx.split(self)
        vocab_axis = VOCAB if self.vocab_parallel else None
        devices = 1 if self.mesh is None else self.mesh.size

        def token_log_probs(state, h, labels, constants=None):
            head = nnx.merge(graphdef, state)
            return head._shard_label_log_probs(h, labels, vocab_axis, constants)

        def local_loss(state, h, labels, where, constants, data_axis=None):
            return chunked_cross_entropy(
                token_log_probs,
                state,
                h,
                labels,
                where,
                token_constants=constants,
                vocab_size=self.vocab_size,
                # This device's columns and its share of the budget (all devices together
                # hold one chunk of the given budget, as on one device).
                elements_per_token=-(-self.elements_per_token // axis_size(self.mesh, VOCAB)),
                memory_budget=max(self.memory_budget // devices, 1),
                buffers_per_element=self.buffers_per_element,
                data_axis=data_axis,
            )

        if self.mesh is None:
            return local_loss(state, h, labels, where, constants)
        return self._on_mesh(
            functools.partial(local_loss, data_axis=DATA),
            state, h, labels, where, constants, out_specs=P(),
        )  # fmt: skip


class SoftmaxHead(OutputHead):
    """``log_softmax(W h + b)``: the bottlenecked baseline (rank <= d + 1 without the bias)."""


class SigsoftmaxHead(OutputHead):
    """``log_sigsoftmax(W h + b)`` (Kanai et al. 2018, eq. 11)."""

    buffers_per_element = 3.0

    def log_scores(self, z: jax.Array) -> jax.Array:
        return sigsoftmax_log_scores(z)


class SigmoidHead(OutputHead):
    """Kanai's sigmoid-based normalizer ``sigma(z_i) / sum_m sigma(z_m)`` (eq. 35)."""

    buffers_per_element = 3.0

    def log_scores(self, z: jax.Array) -> jax.Array:
        return sigmoid_log_scores(z)


class ReLUHead(OutputHead):
    """Kanai's ReLU-based normalizer ``(relu(z_i) + eps) / sum_m (relu(z_m) + eps)`` (eq. 34)."""

    buffers_per_element = 3.0

    def __init__(
        self, in_features: int, vocab_size: int, *, rngs: nnx.Rngs, eps: float = 1e-8, **options
    ):
        super().__init__(in_features, vocab_size, rngs=rngs, **options)
        self.eps = _require_finite("eps", eps, positive=True)

    def log_scores(self, z: jax.Array) -> jax.Array:
        return relu_log_scores(z, eps=self.eps)


class PLIFHead(OutputHead):
    """``log_softmax(plif(W h + b))``: LMS-PLIF (Ganea et al. 2019).

    Args:
      num_knots: ``K >= 2`` segments of the PLIF on ``[-bound, bound]`` (10^5 in the paper).
        ``bn.plif`` takes ``K = 1`` (an affine map), but a head refuses it: ``log_softmax``
        of an affine map of the logits is a softmax with a learned temperature, not the
        nonlinear map a PLIF head stands for.
      bound: ``T``, finite and > 0.
      plif_noise: std (finite, >= 0) of the Gaussian noise added to the identity slopes at
        init.
      (others as :class:`OutputHead`.) The slopes are the parameter ``raw_slopes``; give
      them their own learning rate with :func:`param_labels`.
    """

    buffers_per_element = 7.5

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
        num_knots: int = 100_000,
        bound: float = 20.0,
        plif_noise: float = 0.0,
        **options,
    ):
        num_knots, bound, plif_noise = _check_plif_options(num_knots, bound, plif_noise)
        super().__init__(in_features, vocab_size, rngs=rngs, **options)
        self.bound = bound
        self.raw_slopes = nnx.Param(plif_init(rngs.params(), num_knots, noise=plif_noise))

    def log_scores(self, z: jax.Array) -> jax.Array:
        return plif(z, self.raw_slopes[...], bound=self.bound)


class MonotoneMLPHead(OutputHead):
    """``log_softmax(f(W h + b))`` with Ganea's positive-weight monotone net ``f``.

    Its hidden layer costs ``[N, M, num_hidden]`` (the reason Ganea et al. moved to PLIF);
    :meth:`loss` sizes its chunks for that.
    """

    def __init__(
        self, in_features: int, vocab_size: int, *, rngs: nnx.Rngs, num_hidden: int = 16, **options
    ):
        num_hidden = _require_int("num_hidden", num_hidden, 1)
        super().__init__(in_features, vocab_size, rngs=rngs, **options)
        self.monotone = nnx.data(
            {k: nnx.Param(v) for k, v in monotone_mlp_init(rngs.params(), num_hidden).items()}
        )
        self.num_hidden = num_hidden

    @property
    def elements_per_token(self) -> int:
        return self.vocab_size * self.num_hidden

    buffers_per_element = 4.5

    def log_scores(self, z: jax.Array) -> jax.Array:
        return monotone_mlp(z, {k: v[...] for k, v in self.monotone.items()})


_MIXTURE_NORMALIZERS = ("softmax", "sigsoftmax", "plif")
# buffers_per_element of a mixture by its normalizer: as the single-component heads.
_NORMALIZER_BUFFERS = {"softmax": 2.0, "sigsoftmax": 3.0, "plif": 7.5}


class MixtureHead(OutputHead):
    r"""Mixture of softmaxes (Yang et al. 2018) and its variants MoSS (Kanai) and MoS + PLIF.

    .. math::
       h_k = \tanh(W_k h + c_k), \quad \pi = \mathrm{norm}(w_\pi^\top h), \quad
       p(x \mid h) = \sum_{k=1}^{K} \pi_k\, \mathrm{normalizer}(W h_k + b)_x

    with a decoder ``W`` shared by the components. ``normalizer`` is ``"softmax"`` (MoS),
    ``"sigsoftmax"`` (MoSS; its prior is a sigsoftmax too, as in Kanai et al.) or ``"plif"``
    (MoS over PLIF-mapped logits, Ganea et al.). All mixing is in log space.

    Args:
      num_components: ``K >= 1`` (15 in Yang et al.).
      normalizer: see above.
      latent_features: ``d' >= 1``, the width of each ``h_k`` and of the decoder (default
        ``d``).
      num_knots, bound, plif_noise: PLIF options for ``normalizer="plif"``, checked as
        :class:`PLIFHead`'s.
      (others as :class:`OutputHead`; a tied embedding must be ``[M, d']``.)
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
        num_components: int = 15,
        normalizer: str = "softmax",
        latent_features: int | None = None,
        num_knots: int = 100_000,
        bound: float = 20.0,
        plif_noise: float = 0.0,
        **options,
    ):
        if normalizer not in _MIXTURE_NORMALIZERS:
            raise ValueError(
                f"normalizer must be one of {_MIXTURE_NORMALIZERS}, got {normalizer!r}"
            )
        num_components = _require_int("num_components", num_components, 1)
        if latent_features is not None:
            latent_features = _require_int("latent_features", latent_features, 1)
        # Checked whatever the normalizer, so that no degenerate option passes silently.
        num_knots, bound, plif_noise = _check_plif_options(num_knots, bound, plif_noise)
        self.latent_features = in_features if latent_features is None else latent_features
        self._num_components = num_components
        super().__init__(in_features, vocab_size, rngs=rngs, **options)
        self.normalizer = normalizer
        param_dtype = options.get("param_dtype", jnp.float32)
        self.latent = nnx.Linear(
            in_features, num_components * self.latent_features, rngs=rngs, param_dtype=param_dtype
        )
        self.prior = nnx.Linear(
            in_features, num_components, use_bias=False, rngs=rngs, param_dtype=param_dtype
        )
        if normalizer == "plif":
            self.bound = bound
            self.raw_slopes = nnx.Param(plif_init(rngs.params(), num_knots, noise=plif_noise))

    @property
    def decoder_features(self) -> int:
        return self.latent_features

    @property
    def num_components(self) -> int:
        return self._num_components

    @property
    def buffers_per_element(self) -> float:
        return _NORMALIZER_BUFFERS[self.normalizer]

    def log_scores(self, z: jax.Array) -> jax.Array:
        if self.normalizer == "sigsoftmax":
            return sigsoftmax_log_scores(z)
        if self.normalizer == "plif":
            return plif(z, self.raw_slopes[...], bound=self.bound)
        return softmax_log_scores(z)

    @property
    def latent_mask_features(self) -> int:
        return self.num_components * self.latent_features

    def components(
        self, h: jax.Array, latent_mask: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        latent = jnp.tanh(self.latent(h))
        if latent_mask is not None:  # Yang et al.'s latent dropout
            latent = latent * latent_mask.astype(latent.dtype)
        latent = latent.reshape(*h.shape[:-1], self.num_components, self.latent_features)
        prior_logits = self.prior(h).astype(jnp.float32)
        prior_scores = (
            sigsoftmax_log_scores(prior_logits) if self.normalizer == "sigsoftmax" else prior_logits
        )
        return latent, log_normalize(prior_scores)


_HEADS: dict[str, tuple[type[OutputHead], dict[str, Any]]] = {
    "softmax": (SoftmaxHead, {}),
    "sigsoftmax": (SigsoftmaxHead, {}),
    "sigmoid": (SigmoidHead, {}),
    "relu": (ReLUHead, {}),
    "plif": (PLIFHead, {}),
    "monotone_mlp": (MonotoneMLPHead, {}),
    "mos": (MixtureHead, {"normalizer": "softmax"}),
    "moss": (MixtureHead, {"normalizer": "sigsoftmax"}),
    "mos_plif": (MixtureHead, {"normalizer": "plif"}),
}
HEAD_NAMES = tuple(_HEADS)


def make_head(
    name: str, in_features: int, vocab_size: int, *, rngs: nnx.Rngs, **options
) -> OutputHead:
    """Builds a head by name (for CLIs): one of :data:`HEAD_NAMES`.

    ``"mos"``, ``"moss"`` and ``"mos_plif"`` are :class:`MixtureHead` with the softmax,
    sigsoftmax and PLIF normalizer. ``options`` go to the head's constructor; an option the head
    does not take is a ``ValueError`` that lists those it does.
    """
    if name not in _HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of {', '.join(HEAD_NAMES)}")
    accepted = _COMMON_OPTIONS + _HEAD_OPTIONS.get(name, ())
    refused = sorted(set(options) - set(accepted))
    if refused:
        raise ValueError(
            f"head {name!r} takes no option {', '.join(refused)}; it takes {', '.join(accepted)}"
        )
    head_cls, fixed = _HEADS[name]
    return head_cls(in_features, vocab_size, rngs=rngs, **fixed, **options)


# Every head's constructor takes OutputHead's keyword options; presets add their own.
_COMMON_OPTIONS = tuple(
    name
    for name, parameter in inspect.signature(OutputHead.__init__).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "rngs"
)
_PLIF_OPTIONS = ("num_knots", "bound", "plif_noise")
_MIXTURE_OPTIONS = ("num_components", "latent_features")
_HEAD_OPTIONS: dict[str, tuple[str, ...]] = {
    "relu": ("eps",),
    "plif": _PLIF_OPTIONS,
    "monotone_mlp": ("num_hidden",),
    "mos": _MIXTURE_OPTIONS,
    "moss": _MIXTURE_OPTIONS,
    "mos_plif": _MIXTURE_OPTIONS + _PLIF_OPTIONS,
}


def head_options(name: str, **candidates: Any) -> dict[str, Any]:
    """The subset of ``candidates`` that head ``name`` takes, for configs that hold them all.

    Example:
      >>> head_options("mos_plif", num_knots=10, num_components=4, num_hidden=8, seed=0)
      {'num_knots': 10, 'num_components': 4}
    """
    if name not in _HEADS:
        raise ValueError(f"unknown head {name!r}; choose one of {', '.join(HEAD_NAMES)}")
    accepted = _HEAD_OPTIONS.get(name, ())
    return {key: value for key, value in candidates.items() if key in accepted}


PLIF_SLOPES_LABEL = "plif_slopes"


def param_labels(params: Any) -> Any:
    """Optax labels for a parameter pytree: ``"plif_slopes"`` for PLIF slopes, else ``"default"``.

    For ``optax.multi_transform`` so the slopes get their own learning rate (0.02 in Ganea et
    al.), e.g. ``optax.multi_transform({"default": sgd, "plif_slopes": adam}, param_labels)``.
    """

    def label(path: tuple[Any, ...], _: Any) -> str:
        names = {getattr(entry, "key", getattr(entry, "name", None)) for entry in path}
        return PLIF_SLOPES_LABEL if "raw_slopes" in names else "default"

    return jax.tree_util.tree_map_with_path(label, params)
