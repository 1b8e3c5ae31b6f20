"""Sampling text from a language model: incremental decoding with temperature, top-k and top-p.

:func:`generate` works on any model with the decoding interface :class:`DecodingModel`
(``vocab_size``, ``init_decode_state``, ``prefill``, ``decode_step``), which
:class:`~bottleneck.nn.AWDLSTM` (its recurrent state) and :class:`~bottleneck.nn.Transformer`
(its key-value cache) implement: the prompt is fed once (``prefill``), then each new token once
(``decode_step``) inside a :func:`jax.lax.scan`, so ``N`` new tokens cost ``N`` single-token
steps, never a re-run of the prefix. A model without that interface, one that maps tokens
``[B, T]`` to hidden states ``[B, T, d]``, samples through :class:`HiddenStateDecoder` (no
cache: each step re-runs the model on the whole sequence).

Each token is drawn from the head's log-probabilities ``head(h)`` (a mixture head's are the
mixture's, a PLIF head's ``log_softmax(f(z))``), reshaped by :func:`sampling_log_probs`:
temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), all in log space.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bottleneck._checks import require_int


class DecodingModel(Protocol):
    """What :func:`generate` needs of a model (tokens batch-major, ``[B, ...]``).

    Four members; :func:`generate` checks that they exist before it traces anything
    (:func:`check_decoding_model`), then calls, inside one jitted program (``nnx.jit``: an
    ``nnx.Module``'s parameters are traced, so write the model as one):

    1. ``state = model.init_decode_state(B, P + N - 1)``: an empty state (a pytree of arrays)
       for ``B`` sequences of up to ``P + N - 1`` positions (the prompt's ``P`` and every new
       token but the last, which is never fed back);
    2. ``log_probs, state = model.prefill(state, prompt)``: the prompt ``[B, P]`` int32 in one
       pass; ``log_probs [B, M]`` of the token after it;
    3. ``log_probs, state = model.decode_step(state, token)``, ``N - 1`` times inside a
       :func:`jax.lax.scan`: one token per sequence ``[B]`` int32; the next ``[B, M]``. The
       state's shapes and dtypes must not change from step to step.

    ``vocab_size`` is ``M``, read before tracing (it bounds the prompt's ids and ``top_k``).
    :class:`~bottleneck.nn.Transformer` (a key-value cache) and
    :class:`~bottleneck.nn.AWDLSTM` (its recurrent state) implement it;
    :class:`HiddenStateDecoder` implements it for any model that maps tokens to hidden states
    plus an output head, without a cache.
    """

    vocab_size: int

    def init_decode_state(self, batch_size: int, max_len: int) -> Any:
        """The state before any token, for sequences of up to ``max_len`` positions."""

    def prefill(self, state: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """Feeds ``tokens [B, P]``: log-probs ``[B, M]`` of the next token, and the state."""

    def decode_step(self, state: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """Feeds ``tokens [B]``: log-probs ``[B, M]`` of the next token, and the state."""


_DECODING_METHODS = ("init_decode_state", "prefill", "decode_step")


def check_decoding_model(model: Any) -> int:
    """``model.vocab_size`` if ``model`` has the :class:`DecodingModel` interface.

    Raises:
      ValueError: one paragraph naming what ``model`` lacks (a missing or non-callable method,
        a missing or non-integer ``vocab_size``) and the adapter for a model that maps tokens
        to hidden states, :class:`HiddenStateDecoder`. Raised before anything is traced.
    """
    missing = [name for name in _DECODING_METHODS if not callable(getattr(model, name, None))]
    vocab_size = getattr(model, "vocab_size", None)
    try:
        if isinstance(vocab_size, bool):
            raise TypeError
        vocab_size = operator.index(vocab_size)
        bad_vocab = vocab_size < 1
    except TypeError:
        bad_vocab = True
    if missing or bad_vocab:
        lacks = [f"a method {name}" for name in missing]
        if bad_vocab:
            lacks.insert(0, f"an integer vocab_size >= 1 (it has {vocab_size!r})")
        raise ValueError(
            f"model must have the decoding interface bottleneck.generation.DecodingModel "
            f"(vocab_size, init_decode_state, prefill, decode_step); {type(model).__name__} "
            f"lacks {', '.join(lacks)}. nn.Transformer and nn.AWDLSTM have it. For a model that "
            "maps tokens [B, T] to hidden states [B, T, d], wrap it with its output head: "
            "bn.HiddenStateDecoder(model, head, vocab_size) (no cache: each step re-runs the "
            "whole sequence; see docs/guides/generation.md)."
        )
    return vocab_size


class HiddenStateDecodeState(NamedTuple):
    """:class:`HiddenStateDecoder`'s decoding state: the sequence so far, padded."""

    tokens: jax.Array  # [B, max_len] int32: the fed tokens, then pad_id
    length: jax.Array  # [] int32: how many tokens have been fed


class HiddenStateDecoder(nnx.Module):
    r"""The :class:`DecodingModel` of a model that maps tokens to hidden states, plus a head.

    For your own language model, written without a cache or a carry: ``model`` maps
    ``tokens [B, T]`` to hidden states ``[B, T, d]`` and ``head`` maps ``h [B, d]`` to the
    next token's log-probabilities ``[B, M]`` (an :class:`~bottleneck.nn.OutputHead`, or any
    callable)::

        decoder = bn.HiddenStateDecoder(trunk, head, vocab_size)
        tokens = bn.generate(decoder, prompt, 20, key=jax.random.key(0), top_p=0.95)

    No cache: the state is the sequence so far in a buffer of the ``L = P + N - 1`` positions
    :func:`generate` asks for (the rest ``pad_id``), and ``prefill`` and each ``decode_step``
    run ``model`` on the whole buffer and read the hidden state at the last fed position. The
    shapes never change, so the decoding loop compiles once (per ``B``, ``L``); the cost is
    ``N`` runs of the model over ``L`` positions, ``O(N L)`` token-positions (``O(T^2)`` in the
    sequence length ``T``, and an attention model's ``O(N L^2)``) where a cached decoder does
    ``O(L)``: fine for short samples and small models, the price of not writing a cache.

    ``model`` must be causal (the hidden state at ``t`` depends on ``tokens[:, :t + 1]``
    only): the padding after the last fed token is then never seen. It is called as it is,
    so switch its dropout off first (``model.eval()``). ``model`` and ``head`` as
    ``nnx.Module`` s have their parameters traced by the jitted loop; plain callables are
    compiled in as constants.

    Args:
      model: ``tokens [B, T] int32 -> [B, T, d]``, causal.
      head: ``h [B, d] -> [B, M]`` log-probabilities.
      vocab_size: ``M >= 1``, the head's width.
      max_len: the most positions ``model`` takes (a position table's size), or ``None`` (no
        limit): :func:`generate` refuses ``P + N - 1`` beyond it before tracing.
      pad_id: the id in the positions not fed yet, in ``[0, M)``.

    Example:
      >>> import jax, jax.numpy as jnp, bottleneck as bn
      >>> from flax import nnx
      >>> from bottleneck import nn
      >>> class Trunk(nnx.Module):  # causal: a running mean of the embeddings
      ...     def __init__(self, rngs):
      ...         self.embed = nnx.Embed(50, 8, rngs=rngs)
      ...     def __call__(self, tokens):
      ...         x = self.embed(tokens)
      ...         return jnp.cumsum(x, 1) / jnp.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]
      >>> rngs = nnx.Rngs(0)
      >>> decoder = bn.HiddenStateDecoder(Trunk(rngs), nn.OutputHead(8, 50, rngs=rngs), 50)
      >>> bn.generate(decoder, jnp.array([[1, 2, 3]]), 5, key=jax.random.key(0)).shape
      (1, 5)
    """

    def __init__(
        self,
        model: Callable[[jax.Array], jax.Array],
        head: Callable[[jax.Array], jax.Array],
        vocab_size: int,
        *,
        max_len: int | None = None,
        pad_id: int = 0,
    ):
        if not callable(model):
            raise ValueError(f"model must be callable, tokens [B, T] -> [B, T, d], got {model!r}")
        if not callable(head):
            raise ValueError(f"head must be callable, h [B, d] -> [B, M], got {head!r}")
        self.vocab_size = require_int("vocab_size", vocab_size, 1)
        self.max_len = None if max_len is None else require_int("max_len", max_len, 1)
        self.pad_id = require_int("pad_id", pad_id, 0)
        if self.pad_id >= self.vocab_size:
            raise ValueError(f"pad_id must be in [0, {self.vocab_size}), got {pad_id}")
        self.model = model
        self.head = head

    def init_decode_state(self, batch_size: int, max_len: int) -> HiddenStateDecodeState:
        """An empty sequence buffer ``[batch_size, max_len]`` (all ``pad_id``)."""
        batch_size = require_int("batch_size", batch_size, 1)
        max_len = require_int("max_len", max_len, 1)
        if self.max_len is not None and max_len > self.max_len:
            raise ValueError(
                f"max_len must be in [1, {self.max_len}] (the model's max_len), got {max_len}"
            )
        return HiddenStateDecodeState(
            jnp.full((batch_size, max_len), self.pad_id, jnp.int32), jnp.zeros((), jnp.int32)
        )

    def _extend(
        self, state: HiddenStateDecodeState, tokens: jax.Array
    ) -> tuple[jax.Array, HiddenStateDecodeState]:
        """Appends ``tokens [B, T]``; the log-probs ``[B, M]`` of the token after them."""
        batch, capacity = state.tokens.shape
        if jnp.ndim(tokens) != 2 or tokens.shape[0] != batch or not 1 <= tokens.shape[1]:
            raise ValueError(f"tokens must have shape [{batch}, T], got {jnp.shape(tokens)}")
        if tokens.shape[1] > capacity:
            raise ValueError(
                f"tokens has {tokens.shape[1]} steps, more than the state's capacity ({capacity})"
            )
        buffer = jax.lax.dynamic_update_slice(
            state.tokens, tokens.astype(jnp.int32), (jnp.zeros((), jnp.int32), state.length)
        )
        length = state.length + tokens.shape[1]
        hidden = self.model(buffer)
        if jnp.ndim(hidden) != 3 or hidden.shape[:2] != (batch, capacity):
            raise ValueError(
                f"model must map tokens [B, T] = {(batch, capacity)} to hidden states "
                f"[B, T, d], got shape {jnp.shape(hidden)}"
            )
        last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)
        log_probs = self.head(last)
        if jnp.shape(log_probs) != (batch, self.vocab_size):
            raise ValueError(
                f"head must map h [B, d] to log-probabilities [B, vocab_size] = "
                f"{(batch, self.vocab_size)}, got shape {jnp.shape(log_probs)}"
            )
        # A traced length past the buffer would overwrite its last slots (dynamic_update_slice
        # clamps): NaN instead, as the Transformer's cache does.
        log_probs = jnp.where(length <= capacity, log_probs, jnp.nan)
        return log_probs, HiddenStateDecodeState(buffer, length)

    def prefill(
        self, state: HiddenStateDecodeState, tokens: jax.Array
    ) -> tuple[jax.Array, HiddenStateDecodeState]:
        """Feeds ``tokens [B, P]``: the next token's log-probs ``[B, M]`` and the state."""
        return self._extend(state, tokens)

    def decode_step(
        self, state: HiddenStateDecodeState, tokens: jax.Array
    ) -> tuple[jax.Array, HiddenStateDecodeState]:
        """Feeds ``tokens [B]``: the next token's log-probs ``[B, M]`` and the state."""
        if jnp.ndim(tokens) != 1:
            raise ValueError(f"tokens must have shape [B], got {jnp.shape(tokens)}")
        return self._extend(state, tokens[:, None])


def _check_sampling(
    temperature: Any, top_k: Any, top_p: Any, vocab_size: int
) -> tuple[float, int | None, float | None]:
    """The sampling options as Python numbers; ``ValueError`` naming a bad one."""
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}") from None
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite number > 0, got {temperature!r} "
            "(for greedy decoding use top_k=1)"
        )
    if top_k is not None:
        try:
            if isinstance(top_k, bool):
                raise TypeError
            top_k = operator.index(top_k)
        except TypeError:
            raise ValueError(f"top_k must be an integer or None, got {top_k!r}") from None
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"top_k must be in [1, {vocab_size}] (the vocabulary), got {top_k}")
    if top_p is not None:
        try:
            top_p = float(top_p)
        except (TypeError, ValueError):
            raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}") from None
        if not 0 < top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    return temperature, top_k, top_p


def _filter(log_probs: jax.Array, temperature: Any, top_k: Any, top_p: Any) -> jax.Array:
    """:func:`sampling_log_probs` without the argument checks; the options may be traced.

    ``top_k = M`` and ``top_p = 1`` switch a filter off. Both filters work on one ranking of
    the tokens, so that their values are data, not shapes: one compiled program serves them all.
    """
    scores = jax.nn.log_softmax(log_probs.astype(jnp.float32) / temperature, axis=-1)
    last = scores.ndim - 1
    # Ties keep the lower id first: top-k keeps exactly k tokens.
    order = jnp.argsort(-scores, axis=last, stable=True)
    ranked = jnp.take_along_axis(scores, order, axis=last)
    rank = jnp.arange(scores.shape[-1])
    in_top_k = rank < top_k
    # The nucleus of the top-k distribution: a token stays while the top-k-renormalised mass
    # ranked before it is below top_p, i.e. log(mass before) < log(top_p) + log(top-k mass).
    cumulative = jax.lax.cumlogsumexp(ranked, axis=last)
    top_k_mass = jnp.take_along_axis(cumulative, jnp.full_like(order[..., :1], top_k - 1), last)
    mass_before = jnp.concatenate(
        [jnp.full_like(ranked[..., :1], -jnp.inf), cumulative[..., :-1]], axis=last
    )
    in_nucleus = (mass_before < jnp.log(top_p) + top_k_mass) | (top_p >= 1)
    keep = jnp.put_along_axis(
        jnp.zeros(scores.shape, bool), order, in_top_k & in_nucleus, axis=last, inplace=False
    )
    return jax.nn.log_softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)


def sampling_log_probs(
    log_probs: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    r"""The log-probabilities tokens are drawn from, given the model's ``log_probs [..., M]``.

    In order (the convention of common samplers):

    1. temperature: :math:`\log q \propto \log p / \tau` (:math:`\tau \to 0` approaches greedy
       decoding, :math:`\tau = 1` is the model);
    2. top-k: keep exactly the ``k`` most likely tokens (ties at the ``k``-th resolved towards
       the lower id); ``top_k=1`` is greedy decoding;
    3. top-p (nucleus; Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"):
       keep the smallest set of most likely tokens whose mass reaches ``top_p`` (a token stays
       when the mass ranked before it is below ``top_p``; the most likely always stays), the
       masses accumulated in log space (``cumlogsumexp``). ``top_p=1`` keeps every token.

    After each step the kept tokens are renormalised; the others get ``-inf``.

    Args:
      log_probs: ``[..., M]`` log-probabilities (or any logits: step 1 normalises).
      temperature: finite, > 0.
      top_k: ``None`` (off) or an integer in ``[1, M]``.
      top_p: ``None`` (off) or a number in ``(0, 1]``.

    Returns:
      ``[..., M]`` float32 normalised log-probabilities, ``-inf`` at filtered tokens.
    """
    vocab_size = log_probs.shape[-1]
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, vocab_size)
    return _filter(
        log_probs,
        temperature,
        vocab_size if top_k is None else top_k,
        1.0 if top_p is None else top_p,
    )


# One compiled program for the prefill and the whole scan: eagerly, every step of the loop
# would dispatch op by op. The sampling options are traced, so changing them does not
# recompile; the model's structure, the shapes and num_tokens are static.
@functools.partial(nnx.jit, static_argnames=("num_tokens",))
def _decode(
    model: DecodingModel,
    prompt: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    num_tokens: int,
) -> jax.Array:
    batch, prompt_len = prompt.shape
    # The cache needs the prompt and every new token but the last, which is never fed back.
    state = model.init_decode_state(batch, prompt_len + num_tokens - 1)
    log_probs, state = model.prefill(state, prompt)
    keys = jax.random.split(key, num_tokens)

    def sample(key: jax.Array, log_probs: jax.Array) -> jax.Array:
        return jax.random.categorical(key, _filter(log_probs, temperature, top_k, top_p), axis=-1)

    def step(carry: tuple[jax.Array, Any], key: jax.Array) -> tuple[tuple[jax.Array, Any], Any]:
        token, state = carry
        log_probs, state = model.decode_step(state, token)
        token = sample(key, log_probs)
        return (token, state), token

    first = sample(keys[0], log_probs)
    _, rest = jax.lax.scan(step, (first, state), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1).astype(jnp.int32)


def generate(
    model: DecodingModel,
    prompt_tokens: Any,
    num_tokens: int,
    *,
    key: jax.Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    bat_tau: float | None = None,
) -> jax.Array:
    """Samples ``num_tokens`` tokens after each prompt, one at a time (ancestral sampling).

    Incremental: the prompt is fed once and each sampled token once (a recurrent state, or a
    key-value cache of ``P + num_tokens - 1`` positions), in one jitted program whose
    compilation is cached per model structure, shapes and ``num_tokens`` (not per sampling
    option). Dropout is off. The result is a function of ``key``: the same key gives the same
    tokens.

    Example (in a notebook)::

        tokens = bn.generate(model, vocab.encode("the cat".split())[None], 20,
                             key=jax.random.key(0), temperature=0.8, top_p=0.95)
        print(" ".join(vocab.decode(tokens[0])))

    Args:
      model: a :class:`DecodingModel` (:class:`~bottleneck.nn.AWDLSTM`,
        :class:`~bottleneck.nn.Transformer`, or any model that maps tokens to hidden states
        wrapped with its head in a :class:`HiddenStateDecoder`); checked before tracing, a
        ``ValueError`` naming what it lacks.
      prompt_tokens: ``[B, P]`` integer ids in ``[0, M)``, ``B, P >= 1``; concrete (not traced).
        A Transformer needs ``P + num_tokens - 1 <= max_len``.
      num_tokens: ``N >= 1`` tokens to sample per prompt.
      key: PRNG key.
      temperature, top_k, top_p: see :func:`sampling_log_probs`; ``top_k=1`` is greedy.
      bat_tau: ``None`` (off) or basis-aware truncation (Finlayson et al. 2024,
        :func:`bottleneck.bat_keep_mask`) at threshold ``tau`` in ``(0, 1)``, after the other
        filters: among the tokens they keep, those that the model's log-probabilities (at
        temperature 1) and decoder prove possible. Plain softmax heads only (``OutputHead`` with
        one component, no pointwise map, the softmax normalizer). Host-side: the model runs one
        jitted step at a time and each row draws tokens in Gumbel order (the same draw as
        without BAT) until one is kept, the argmax if none; a drawn token below ``tau`` costs a
        linear program unless a cheap certificate keeps or discards it (seconds at
        ``M = 10,000``). A progress bar appears on stderr once a draw takes seconds; Ctrl-C
        stops it at once.

    Returns:
      ``[B, N]`` int32 sampled ids (the prompt not included).
    """
    vocab_size = check_decoding_model(model)
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, vocab_size)
    try:
        if isinstance(num_tokens, bool):
            raise TypeError
        num_tokens = operator.index(num_tokens)
    except TypeError:
        raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}") from None
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    prompt = np.asarray(prompt_tokens)
    if prompt.ndim != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(
            f"prompt_tokens must have shape [B, P] with B, P >= 1, got {prompt.shape} (an empty "
            "prompt has nothing to condition on: start from a token such as <eos>)"
        )
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_tokens must hold integer ids, got dtype {prompt.dtype}")
    if prompt.min() < 0 or prompt.max() >= vocab_size:
        raise ValueError(
            f"prompt_tokens must lie in [0, {vocab_size}), got ids in "
            f"[{prompt.min()}, {prompt.max()}]"
        )
    if bat_tau is not None:
        return _generate_bat(
            model, prompt, key, temperature, top_k, top_p, bat_tau, num_tokens=num_tokens
        )
    return _decode(
        model,
        jnp.asarray(prompt, jnp.int32),
        key,
        jnp.float32(temperature),
        jnp.int32(vocab_size if top_k is None else top_k),
        jnp.float32(1.0 if top_p is None else top_p),
        num_tokens=num_tokens,
    )


@nnx.jit
def _prefill(model: DecodingModel, state: Any, prompt: jax.Array) -> tuple[jax.Array, Any]:
    return model.prefill(state, prompt)


@nnx.jit
def _decode_step(model: DecodingModel, state: Any, token: jax.Array) -> tuple[jax.Array, Any]:
    return model.decode_step(state, token)


def _generate_bat(
    model: Any,
    prompt: np.ndarray,
    key: jax.Array,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    tau: Any,
    *,
    num_tokens: int,
) -> jax.Array:
    """:func:`generate` with basis-aware truncation: a host loop over jitted steps."""
    from tqdm.auto import tqdm

    from bottleneck.nn.heads import OutputHead
    from bottleneck.nn.pieces import NORMALIZERS
    from bottleneck.truncation import BatProblem

    head = getattr(model, "head", None)
    if not (
        isinstance(head, OutputHead)
        and not head.is_mixture
        and head.pointwise is None
        and head.normalizer is NORMALIZERS["softmax"]
    ):
        raise ValueError(
            "bat_tau needs a plain softmax head (model.head an OutputHead with one component, no "
            "pointwise map, the softmax normalizer): its moment condition W^T p* = W^T p holds "
            "for those only"
        )
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < 1:
        raise ValueError(f"bat_tau must be a number in (0, 1) or None, got {tau!r}")
    vocab_size = model.vocab_size
    decoder = np.asarray(head.decoder[...], np.float64)[:vocab_size]
    filter_options = (
        jnp.float32(temperature),
        jnp.int32(vocab_size if top_k is None else top_k),
        jnp.float32(1.0 if top_p is None else top_p),
    )
    batch, prompt_len = prompt.shape
    state = model.init_decode_state(batch, prompt_len + num_tokens - 1)
    log_probs, state = _prefill(model, state, jnp.asarray(prompt, jnp.int32))
    keys = jax.random.split(key, num_tokens)
    tokens = []
    # Shown only once a draw has taken a few seconds (a linear program can take tens of them).
    bar = tqdm(range(num_tokens), desc="BAT", unit="token", delay=3, leave=False)
    programs = 0
    for step in bar:
        if step:
            log_probs, state = _decode_step(model, state, jnp.asarray(tokens[-1]))
        filtered = np.asarray(_jit_filter(log_probs, *filter_options))
        # jax.random.categorical's draw: the argmax of logits + Gumbel noise; the Gumbel order
        # is a draw without replacement, so its first kept token follows the kept distribution.
        ranked = filtered + np.asarray(jax.random.gumbel(keys[step], filtered.shape))
        model_log_probs = np.asarray(log_probs, np.float64)
        chosen = np.empty(batch, np.int32)
        for row in range(batch):
            order = np.argsort(-ranked[row], kind="stable")
            order = order[np.isfinite(filtered[row, order])]
            chosen[row] = np.argmax(filtered[row])  # if BAT keeps none of them
            problem = BatProblem(model_log_probs[row], decoder, tau)
            for token in order:
                if problem.keep(int(token)):
                    chosen[row] = token
                    break
            programs += problem.programs
            bar.set_postfix(row=row, linear_programs=programs, refresh=False)
        tokens.append(chosen)
    bar.close()
    return jnp.asarray(np.stack(tokens, axis=1), jnp.int32)


_jit_filter = jax.jit(_filter)
