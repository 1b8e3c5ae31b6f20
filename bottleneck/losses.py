"""Losses: cross-entropy on log-probabilities, and the chunked (memory-bounded) head loss."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from bottleneck._checks import as_compute, require_float, require_ndim


def _check_labels(log_probs: jax.Array, labels: jax.Array, where: jax.Array | None) -> None:
    require_float("log_probs", log_probs)
    require_ndim("log_probs", log_probs, 1, "[..., vocab]")
    if not jnp.issubdtype(jnp.asarray(labels).dtype, jnp.integer):
        raise ValueError(f"labels must have an integer dtype, got {jnp.asarray(labels).dtype}")
    if jnp.shape(labels) != jnp.shape(log_probs)[:-1]:
        raise ValueError(
            f"labels must have shape {jnp.shape(log_probs)[:-1]} (log_probs {jnp.shape(log_probs)} "
            f"without its vocab axis), got {jnp.shape(labels)}"
        )
    if where is not None and jnp.shape(where) != jnp.shape(labels):
        raise ValueError(
            f"where must have shape {jnp.shape(labels)} like labels, got {jnp.shape(where)}"
        )


def cross_entropy(
    log_probs: jax.Array, labels: jax.Array, where: jax.Array | None = None
) -> jax.Array:
    r"""Mean negative log-likelihood of integer labels over the unmasked positions.

    .. math:: \mathcal{L} = -\frac{1}{|\{n: w_n\}|} \sum_{n:\,w_n} \log p_n(y_n)

    Args:
      log_probs: ``[..., vocab]`` log-probabilities (any normalizer's output).
      labels: ``[...]`` integer targets in ``[0, vocab)``.
      where: optional ``[...]`` boolean mask; ``False`` positions are ignored (padding).
        With every position masked the loss is 0.

    Returns:
      Scalar float32 (or wider) mean NLL.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> lp = bn.log_softmax(jnp.zeros((2, 4)))
      >>> round(float(bn.cross_entropy(lp, jnp.array([0, 3]))), 4)  # log 4
      1.3863
    """
    _check_labels(log_probs, labels, where)
    log_probs = as_compute(log_probs)
    picked = jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if where is None:
        return -jnp.mean(picked)
    where = jnp.asarray(where, bool)
    total = jnp.sum(jnp.where(where, picked, jnp.zeros((), picked.dtype)))
    count = jnp.maximum(jnp.sum(where), 1).astype(picked.dtype)
    return -total / count


def target_log_probs(
    log_scores: jax.Array,
    labels: jax.Array,
    *,
    vocab_axis: str | None = None,
    vocab_offset: jax.Array | int = 0,
) -> jax.Array:
    r"""Log-probability of each label under ``log_normalize(log_scores)``, without building it.

    .. math:: \log p(y) = s_y - \operatorname{logsumexp}_m s_m

    Inside ``shard_map`` with the vocabulary split over mesh axis ``vocab_axis``, each shard
    holds columns ``[vocab_offset, vocab_offset + M_local)``; the row maximum is combined with
    ``pmax``, the sum of exponentials and the label's score with ``psum`` (Megatron's
    vocab-parallel cross-entropy), so every shard returns the same global result.

    Args:
      log_scores: ``[..., vocab]`` (or this shard's ``[..., M_local]``) log scores ``log g(z)``.
      labels: ``[...]`` integer targets (global indices).
      vocab_axis: mesh axis the vocabulary is split over, or ``None``.
      vocab_offset: global index of this shard's first column.

    Returns:
      ``[...]`` log-probabilities of the labels, dtype at least float32.
    """
    scores = as_compute(log_scores)
    local_size = scores.shape[-1]
    local_labels = labels.astype(jnp.int32) - vocab_offset
    in_shard = (local_labels >= 0) & (local_labels < local_size)
    index = jnp.clip(local_labels, 0, local_size - 1)[..., None]
    picked = jnp.take_along_axis(scores, index, axis=-1)[..., 0]
    picked = jnp.where(in_shard, picked, jnp.zeros((), scores.dtype))
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1))
    if vocab_axis is not None:
        row_max = jax.lax.pmax(row_max, vocab_axis)
    sum_exp = jnp.sum(jnp.exp(scores - row_max[..., None]), axis=-1)
    if vocab_axis is not None:
        sum_exp = jax.lax.psum(sum_exp, vocab_axis)
        picked = jax.lax.psum(picked, vocab_axis)
    return picked - row_max - jnp.log(sum_exp)


# Live float32 [tokens, elements_per_token] buffers that the value-and-gradient of one chunk
# keeps at its peak (scores, their exponentials, the gradient); measured with
# compiled.memory_analysis() for every head in tests/nn/test_heads.py.
_LIVE_BUFFERS_PER_ELEMENT = 4
DEFAULT_MEMORY_BUDGET = 32 * 2**20


def chunk_size_for_budget(
    num_tokens: int, elements_per_token: int, memory_budget: int, multiple: int = 1
) -> int:
    """Tokens per chunk so that one chunk's float32 work stays within ``memory_budget`` bytes.

    Rounded up to a multiple of ``multiple`` (the data-parallel shards, which split each chunk).
    """
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
    bytes_per_token = 4 * _LIVE_BUFFERS_PER_ELEMENT * max(elements_per_token, 1)
    chunk = min(max(memory_budget // bytes_per_token, 1), max(num_tokens, 1))
    return int(-(-chunk // multiple) * multiple)


def chunked_cross_entropy(
    token_log_probs: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: Any,
    hidden: jax.Array,
    labels: jax.Array,
    where: jax.Array | None = None,
    *,
    elements_per_token: int,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    token_multiple: int = 1,
) -> jax.Array:
    r"""Mean NLL of an output head, computed in token chunks so peak memory stays bounded.

    The one memory-bounded loss mechanism that every head in :mod:`bottleneck.nn` uses. The head
    supplies ``token_log_probs(params, hidden_chunk [C, d], labels_chunk [C]) -> [C]``, the log
    probability of each label (its logits, pointwise map, normalizer and mixture); this function
    never holds more than one chunk's ``[C, elements_per_token]`` intermediates, never the full
    ``[N, M]`` logits nor the ``[N, K, M]`` of a mixture.

    The gradient is fused into the forward pass (as in Liger's fused linear cross-entropy): each
    chunk's loss and gradient come from one ``jax.value_and_grad`` while its logits are live,
    the parameter gradients accumulate in float32, and the custom VJP only scales the saved
    gradients by the incoming cotangent. That costs the three matmuls of plain autodiff (logits,
    d hidden, d weights) instead of the four of a recompute-in-backward scheme, and saves only
    ``[N, d]`` + parameter-sized residuals. Without differentiation only the forward chunks run.
    When everything fits in ``memory_budget`` there is a single chunk and no loop.

    .. math:: \mathcal{L} = -\frac{1}{\sum_n w_n} \sum_n w_n \log p_\theta(y_n \mid h_n)

    Args:
      token_log_probs: pure function of ``(params, hidden [C, d], labels [C])`` returning ``[C]``.
      params: pytree of parameters (differentiable).
      hidden: ``[..., d]`` hidden states (differentiable).
      labels: ``[...]`` integer targets.
      where: optional ``[...]`` boolean mask of the positions that count.
      elements_per_token: size of the per-token intermediate (``M``, ``K * M`` for a mixture).
      memory_budget: bytes one chunk may use.
      token_multiple: chunk sizes are multiples of this (the data-parallel shards). Chunks
        take every ``num_chunks``-th token, so a token axis sharded in contiguous blocks gives
        each shard an equal part of every chunk without moving data.

    Returns:
      Scalar mean NLL (float32), equal to ``cross_entropy(log_probs, labels, where)``.
    """
    require_float("hidden", hidden)
    require_ndim("hidden", hidden, 1, "[..., d]")
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must have an integer dtype, got {labels.dtype}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape {hidden.shape[:-1]} (hidden {hidden.shape} without its "
            f"feature axis), got {labels.shape}"
        )
    if where is not None and jnp.shape(where) != labels.shape:
        raise ValueError(
            f"where must have shape {labels.shape} like labels, got {jnp.shape(where)}"
        )
    num_tokens = labels.size
    hidden_flat = hidden.reshape(num_tokens, hidden.shape[-1])
    labels_flat = labels.reshape(num_tokens).astype(jnp.int32)
    if where is None:
        weights = jnp.full((num_tokens,), 1.0 / max(num_tokens, 1), jnp.float32)
    else:
        mask = jnp.asarray(where, bool).reshape(num_tokens)
        weights = mask.astype(jnp.float32) / jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
    chunk = chunk_size_for_budget(num_tokens, elements_per_token, memory_budget, token_multiple)
    padding = -num_tokens % chunk
    if padding:  # padded tokens carry zero weight, so they change neither loss nor gradients
        hidden_flat = jnp.pad(hidden_flat, ((0, padding), (0, 0)))
        labels_flat = jnp.pad(labels_flat, (0, padding))
        weights = jnp.pad(weights, (0, padding))
    loss = _fused_weighted_nll(token_log_probs, chunk, params, hidden_flat, labels_flat, weights)
    return loss


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``[num_chunks * chunk, ...] -> [num_chunks, chunk, ...]``, chunk ``i`` = tokens ``i::num_chunks``."""
    return jnp.swapaxes(x.reshape(chunk, x.shape[0] // chunk, *x.shape[1:]), 0, 1)


def _unchunk(x: jax.Array) -> jax.Array:
    """Inverse of :func:`_chunks`."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_weighted_nll(token_log_probs, chunk, params, hidden, labels, weights):
    def chunk_loss(carry, xs):
        h, y, w = xs
        return carry - jnp.sum(w * token_log_probs(params, h, y).astype(jnp.float32)), None

    xs = (_chunks(hidden, chunk), _chunks(labels, chunk), _chunks(weights, chunk))
    return jax.lax.scan(chunk_loss, jnp.zeros((), jnp.float32), xs)[0]


def _fused_weighted_nll_fwd(token_log_probs, chunk, params, hidden, labels, weights):
    def value_and_grads(h, y, w):
        def weighted_nll(p, h):
            return -jnp.sum(w * token_log_probs(p, h, y).astype(jnp.float32))

        return jax.value_and_grad(weighted_nll, argnums=(0, 1))(params, h)

    if hidden.shape[0] == chunk:
        loss, (grad_params, grad_hidden) = value_and_grads(hidden, labels, weights)
    else:

        def step(carry, xs):
            loss, grad_params = carry
            chunk_loss, (chunk_grad_params, grad_hidden) = value_and_grads(*xs)
            grad_params = jax.tree.map(
                lambda acc, g: acc + g.astype(jnp.float32), grad_params, chunk_grad_params
            )
            return (loss + chunk_loss, grad_params), grad_hidden

        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        xs = (_chunks(hidden, chunk), _chunks(labels, chunk), _chunks(weights, chunk))
        (loss, grad_params), grad_hidden = jax.lax.scan(
            step, (jnp.zeros((), jnp.float32), zeros), xs
        )
        grad_hidden = _unchunk(grad_hidden)
        grad_params = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grad_params, params)
    return loss, (grad_params, grad_hidden)


def _fused_weighted_nll_bwd(token_log_probs, chunk, residuals, cotangent):
    grad_params, grad_hidden = residuals
    scale = cotangent.astype(jnp.float32)
    return (
        jax.tree.map(lambda g: (scale * g.astype(jnp.float32)).astype(g.dtype), grad_params),
        (scale * grad_hidden.astype(jnp.float32)).astype(grad_hidden.dtype),
        None,
        None,
    )


_fused_weighted_nll.defvjp(_fused_weighted_nll_fwd, _fused_weighted_nll_bwd)
