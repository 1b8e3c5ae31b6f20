"""Sampling text from a language model: incremental decoding with temperature, top-k and top-p.

:func:`generate` works on any model with the decoding interface of
:class:`~bottleneck.nn.AWDLSTM` (its recurrent state) and :class:`~bottleneck.nn.Transformer`
(its key-value cache), :class:`DecodingModel`: the prompt is fed once (``prefill``), then each
new token once (``decode_step``) inside a :func:`jax.lax.scan`, so ``N`` new tokens cost ``N``
single-token steps, never a re-run of the prefix.

Each token is drawn from the head's log-probabilities ``head(h)`` (a mixture head's are the
mixture's, a PLIF head's ``log_softmax(f(z))``), reshaped by :func:`sampling_log_probs`:
temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), all in log space.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class DecodingModel(Protocol):
    """What :func:`generate` needs of a model (tokens batch-major, ``[B, ...]``)."""

    vocab_size: int

    def init_decode_state(self, batch_size: int, max_len: int) -> Any:
        """The state before any token, for sequences of up to ``max_len`` positions."""

    def prefill(self, state: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """Feeds ``tokens [B, P]``: log-probs ``[B, M]`` of the next token, and the state."""

    def decode_step(self, state: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """Feeds ``tokens [B]``: log-probs ``[B, M]`` of the next token, and the state."""


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
        :class:`~bottleneck.nn.Transformer`).
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
        linear program unless a cheap certificate keeps it (seconds at ``M = 10,000``).

    Returns:
      ``[B, N]`` int32 sampled ids (the prompt not included).
    """
    vocab_size = model.vocab_size
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
    from bottleneck.nn.heads import OutputHead
    from bottleneck.nn.pieces import NORMALIZERS
    from bottleneck.truncation import bat_keep_mask

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
    for step in range(num_tokens):
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
            for token in order:
                if bat_keep_mask(model_log_probs[row], decoder, tau=tau, tokens=[token])[0]:
                    chosen[row] = token
                    break
        tokens.append(chosen)
    return jnp.asarray(np.stack(tokens, axis=1), jnp.int32)


_jit_filter = jax.jit(_filter)
