"""Losses: cross-entropy on log-probabilities, and the chunked (memory-bounded) head loss."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bottleneck._checks import as_compute, require_float, require_ndim
from bottleneck._vma import mark_varying, reduce_like, varying_axes
from bottleneck.normalizers import vocab_axis


def labels_are_concrete(labels: Any) -> bool:
    """Whether ``labels`` hold values Python can read now (not a tracer under ``jit``/``grad``).

    A multi-host array that this process cannot read whole counts as traced: it is checked
    inside the computation instead (see :func:`valid_labels`).
    """
    if isinstance(labels, jax.core.Tracer):
        return False
    return not (isinstance(labels, jax.Array) and not labels.is_fully_addressable)


def check_label_range(labels: Any, vocab_size: int, name: str = "labels") -> None:
    """``ValueError`` unless ``labels`` are integers, naming ``[0, vocab_size)`` if concrete
    ``labels`` fall outside it.

    The dtype is checked traced or not. Every label is checked, at masked-out (``where=False``) positions too: padding must carry a
    valid class (0, say), not a sentinel such as -1. Traced labels are not checked here; the
    functions that take them fold :func:`valid_labels` into their result instead (NaN).
    """
    if not jnp.issubdtype(jnp.asarray(labels).dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {jnp.asarray(labels).dtype}")
    if not labels_are_concrete(labels) or np.size(labels) == 0:
        return
    if isinstance(labels, jax.Array):
        # Eagerly, also when a concrete array is closed over inside a trace: two scalars
        # travel to the host, not the labels.
        with jax.ensure_compile_time_eval():
            low, high = (int(v) for v in jax.device_get((jnp.min(labels), jnp.max(labels))))
    else:
        array = np.asarray(labels)
        low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{name} must lie in [0, {vocab_size}) (the vocabulary), got values in [{low}, {high}]"
        )


def valid_labels(labels: jax.Array, vocab_size: int) -> jax.Array:
    """``0 <= labels < vocab_size`` elementwise, compared without narrowing the labels first.

    Labels narrower than int32 are widened, wider ones compared in their own dtype, so no
    out-of-range value (int64 ``2**32``, say) can wrap into range before it is checked.
    """
    labels = jnp.asarray(labels)
    if labels.dtype.itemsize < 4:
        labels = labels.astype(jnp.int32)
    return (labels >= 0) & (labels < vocab_size)


def nan_unless(valid: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` where ``valid``, NaN elsewhere; NaN in value *and* gradient.

    ``x * where(valid, 1, nan)``: exact (``x * 1``) for valid entries, while an invalid one
    makes the result and every gradient that flows through it NaN, so a bad label under
    ``jit`` cannot yield a plausible loss nor a plausible update. (``where(valid, x, nan)``
    would give NaN values but silently zero gradients.)
    """
    factor = jnp.where(valid, jnp.ones((), x.dtype), jnp.full((), jnp.nan, x.dtype))
    return x * factor


def _check_labels(
    log_probs_shape: tuple[int, ...], axis: int, labels: jax.Array, where: jax.Array | None
) -> None:
    """Shapes of ``labels`` and ``where``: ``log_probs``'s without ``axis``."""
    expected = log_probs_shape[:axis] + log_probs_shape[axis + 1 :]
    if jnp.shape(labels) != expected:
        raise ValueError(
            f"labels must have shape {expected} (log_probs {log_probs_shape} without its vocab "
            f"axis {axis}), got {jnp.shape(labels)}"
        )
    if where is not None and jnp.shape(where) != jnp.shape(labels):
        raise ValueError(
            f"where must have shape {jnp.shape(labels)} like labels, got {jnp.shape(where)}"
        )


def cross_entropy(
    log_probs: jax.Array, labels: jax.Array, where: jax.Array | None = None, axis: int = -1
) -> jax.Array:
    r"""Mean negative log-likelihood of integer labels over the unmasked positions.

    .. math:: \mathcal{L} = -\frac{1}{|\{n: w_n\}|} \sum_{n:\,w_n} \log p_n(y_n)

    Args:
      log_probs: ``[..., vocab]`` log-probabilities (any normalizer's output), the vocabulary
        on ``axis``.
      labels: ``[...]`` integer targets in ``[0, vocab)``: ``log_probs``'s shape without
        ``axis``.
      where: optional ``[...]`` boolean mask (shape of ``labels``); ``False`` positions are
        ignored (padding). With every position masked the loss is 0.
      axis: the vocabulary axis of ``log_probs`` (default ``-1``).

    Returns:
      Scalar float32 (or wider) mean NLL.

    Raises:
      ValueError: bad shapes or dtypes, ``axis`` out of range, an empty vocabulary, or concrete
        labels outside ``[0, vocab)``, at masked positions too. Under tracing (``jit``,
        ``grad``, ``vmap``) labels cannot be read, and any label outside ``[0, vocab)``, masked
        or not, makes the loss and its gradients NaN instead (never a plausible number).

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> lp = bn.log_softmax(jnp.zeros((2, 4)))
      >>> round(float(bn.cross_entropy(lp, jnp.array([0, 3]))), 4)  # log 4
      1.3863
    """
    require_float("log_probs", log_probs)
    require_ndim("log_probs", log_probs, 1, "[..., vocab]")
    axis = vocab_axis("log_probs", log_probs, axis)
    _check_labels(jnp.shape(log_probs), axis, labels, where)
    log_probs = jnp.moveaxis(jnp.asarray(log_probs), axis, -1)
    vocab_size = log_probs.shape[-1]
    check_label_range(labels, vocab_size)
    labels = jnp.asarray(labels)
    valid = valid_labels(labels, vocab_size)
    log_probs = as_compute(log_probs)
    index = jnp.where(valid, labels, jnp.zeros((), labels.dtype)).astype(jnp.int32)
    picked = jnp.take_along_axis(log_probs, index[..., None], axis=-1)[..., 0]
    if where is None:
        loss = -jnp.mean(picked)
    else:
        where = jnp.asarray(where, bool)
        total = jnp.sum(jnp.where(where, picked, jnp.zeros((), picked.dtype)))
        count = jnp.maximum(jnp.sum(where), 1).astype(picked.dtype)
        loss = -total / count
    return nan_unless(jnp.all(valid), loss)


def target_log_probs(
    log_scores: jax.Array,
    labels: jax.Array,
    *,
    vocab_axis: str | None = None,
    vocab_offset: jax.Array | int = 0,
    vocab_size: int | None = None,
) -> jax.Array:
    r"""Log-probability of each label under ``log_normalize(log_scores)``, without building it.

    .. math:: \log p(y) = s_y - \operatorname{logsumexp}_m s_m

    Inside ``shard_map`` with the vocabulary split over mesh axis ``vocab_axis``, each shard
    holds columns ``[vocab_offset, vocab_offset + M_local)``; the row maximum is combined with
    ``pmax``, the sum of exponentials and the label's score with ``psum`` (Megatron's
    vocab-parallel cross-entropy), so every shard returns the same global result.

    Args:
      log_scores: ``[..., vocab]`` (or this shard's ``[..., M_local]``) log scores ``log g(z)``.
      labels: ``[...]`` integer targets (global indices) in ``[0, vocab_size)``.
      vocab_axis: mesh axis the vocabulary is split over, or ``None``.
      vocab_offset: global index of this shard's first column.
      vocab_size: number of real classes (global); default all columns, ``M_local`` times the
        size of ``vocab_axis``. Smaller when the last columns are padding (a vocabulary
        padded to split evenly over a mesh): a label there is out of range too.

    Returns:
      ``[...]`` log-probabilities of the labels, dtype at least float32.

    Raises:
      ValueError: concrete labels outside ``[0, vocab_size)``. Traced labels (under ``jit``,
        inside ``shard_map``) cannot be read: an out-of-range one gets NaN, in value and
        gradient, at its position.
    """
    require_float("log_scores", log_scores)
    require_ndim("log_scores", log_scores, 1, "[..., vocab]")
    scores = as_compute(log_scores)
    local_size = scores.shape[-1]
    if vocab_size is None:
        shards = 1 if vocab_axis is None else jax.lax.axis_size(vocab_axis)
        vocab_size = local_size * shards
    check_label_range(labels, vocab_size)
    labels = jnp.asarray(labels)
    valid = valid_labels(labels, vocab_size)
    local_labels = labels.astype(jnp.int32) - vocab_offset
    in_shard = (local_labels >= 0) & (local_labels < local_size)
    index = jnp.clip(local_labels, 0, local_size - 1)[..., None]
    picked = jnp.take_along_axis(scores, index, axis=-1)[..., 0]
    picked = jnp.where(in_shard, picked, jnp.zeros((), scores.dtype))
    if vocab_axis is not None:
        picked = jax.lax.psum(picked, vocab_axis)
    return nan_unless(valid, picked - log_partition(scores, vocab_axis=vocab_axis))


def log_partition(
    *log_scores: jax.Array, vocab_axis: str | None = None, reverse_only: bool = False
) -> jax.Array:
    r"""``log Z``: the log-sum-exp over the vocabulary of one or more blocks of log-scores.

    .. math:: \log Z = \log \sum_b \sum_{m} \exp s^{(b)}_m

    The blocks ``[..., M_b]`` (same leading shape) together hold the vocabulary's columns, in
    any order: a head whose columns are computed in parts (Mixtape's frequent tokens and its
    shared-gate tokens) normalizes over them without concatenating them into ``[..., M]``.
    Entries at ``-inf`` (padding columns) count for nothing; a block of zero columns is
    skipped. Inside ``shard_map`` with the vocabulary split over ``vocab_axis``, the row
    maximum is combined with ``pmax`` and the sum of exponentials with ``psum``.

    Args:
      *log_scores: one or more ``[..., M_b]`` floating arrays of log-scores ``log g(z)``.
      vocab_axis: mesh axis the vocabulary is split over, or ``None``.
      reverse_only: differentiate through a hand-written VJP that writes the gradient
        ``exp(s - log Z)`` once, recomputed from the scores (the forward pass writes no
        ``[..., M]`` array), instead of plain autodiff, which keeps the exponentials as a
        residual beside it; forward mode (``jax.jvp``) cannot go through it. The chunked
        head losses set it.

    Returns:
      ``[...]`` log-partition, dtype at least float32.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> round(float(bn.log_partition(jnp.zeros(3), jnp.zeros(1))), 4)  # log 4
      1.3863
    """
    if not log_scores:
        raise ValueError("log_partition needs at least one block of log-scores")
    for block in log_scores:
        require_float("log_scores", block)
        require_ndim("log_scores", block, 1, "[..., vocab]")
    blocks = tuple(as_compute(block) for block in log_scores if block.shape[-1])
    if not blocks:
        raise ValueError("log_partition needs at least one vocabulary column; every block is empty")
    if reverse_only:
        return _log_partition(vocab_axis, *blocks)
    return _log_partition_value(vocab_axis, *blocks)


def _log_partition_value(vocab_axis: str | None, *blocks: jax.Array) -> jax.Array:
    # The maximum only shifts the exponentials; the result does not depend on it.
    row_max = functools.reduce(jnp.maximum, [jnp.max(block, axis=-1) for block in blocks])
    if vocab_axis is not None:
        row_max = jax.lax.pmax(row_max, vocab_axis)
    sum_exp = sum(jnp.sum(jnp.exp(block - row_max[..., None]), axis=-1) for block in blocks)
    if vocab_axis is not None:
        sum_exp = jax.lax.psum(sum_exp, vocab_axis)
    return row_max + jnp.log(sum_exp)


_log_partition = jax.custom_vjp(_log_partition_value, nondiff_argnums=(0,))


def _log_partition_fwd(vocab_axis, *blocks):
    log_z = _log_partition(vocab_axis, *blocks)
    return log_z, (blocks, log_z)


def _log_partition_bwd(vocab_axis, residuals, cotangent):
    # d log Z / d s_m = exp(s_m - log Z), recomputed from the scores rather than saved.
    blocks, log_z = residuals
    return tuple(
        reduce_like(cotangent[..., None] * jnp.exp(block - log_z[..., None]), block)
        for block in blocks
    )


_log_partition.defvjp(_log_partition_fwd, _log_partition_bwd)


DEFAULT_MEMORY_BUDGET = 32 * 2**20


def chunk_size_for_budget(
    num_tokens: int, elements_per_token: int, memory_budget: int, buffers_per_element: float = 4.0
) -> int:
    """Tokens per chunk so that one chunk's float32 work stays within ``memory_budget`` bytes.

    One chunk of ``C`` tokens holds ``buffers_per_element`` float32 buffers of
    ``[C, elements_per_token]`` at its peak (logits, their exponentials, the gradient, ...).
    The chunks are then evened out (``ceil(num_tokens / num_chunks)`` each), so that the last
    one, which overlaps its predecessor, repeats fewer than ``num_chunks`` tokens.
    """
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
    if buffers_per_element <= 0:
        raise ValueError(f"buffers_per_element must be > 0, got {buffers_per_element}")
    bytes_per_token = 4 * buffers_per_element * max(elements_per_token, 1)
    largest = int(min(max(memory_budget // bytes_per_token, 1), max(num_tokens, 1)))
    num_chunks = -(-max(num_tokens, 1) // largest)
    return -(-max(num_tokens, 1) // num_chunks)


def measure_buffers_per_element(
    token_log_probs: Callable[..., jax.Array],
    params: Any,
    hidden_row: jax.ShapeDtypeStruct,
    *,
    elements_per_token: int,
    token_constants: Any = None,
    probe_tokens: int = 64,
) -> float:
    """Float32 buffers of ``[C, elements_per_token]`` one chunk of ``token_log_probs`` keeps live.

    For :func:`chunked_cross_entropy`'s ``buffers_per_element`` when the computation is not
    known in advance (a user's pointwise map or normalizer): compiles the value and gradient of
    ``sum(token_log_probs(params, hidden [C, d], labels [C]))`` for ``C = probe_tokens`` and
    ``2 C`` and reads the compiler's temporary memory (``memory_analysis``); the growth per
    token, in units of ``4 * elements_per_token`` bytes, is the answer (at least 1). Runs at
    trace time on abstract shapes; no data is touched.

    Args:
      token_log_probs: as for :func:`chunked_cross_entropy`.
      params: pytree of ``jax.ShapeDtypeStruct`` (or arrays) of the parameters.
      hidden_row: shape and dtype of one token's hidden vector ``[d]``.
      elements_per_token: size of the per-token intermediate the chunks are sized by.
      token_constants: optional pytree of one token's constants (shape and dtype).
      probe_tokens: ``C``.
    """
    abstract = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))  # noqa: E731
    params = jax.tree.map(abstract, params)

    def temporary_bytes(tokens: int) -> int:
        def value_and_grad(params, hidden, labels, constants):
            def total(params, hidden):
                return jnp.sum(_call(token_log_probs, params, hidden, labels, constants))

            return jax.value_and_grad(total, argnums=(0, 1))(params, hidden)

        rows = lambda row: jax.ShapeDtypeStruct((tokens, *row.shape), row.dtype)  # noqa: E731
        compiled = (
            jax.jit(value_and_grad)
            .lower(
                params,
                rows(hidden_row),
                jax.ShapeDtypeStruct((tokens,), jnp.int32),
                jax.tree.map(rows, token_constants),
            )
            .compile()
        )
        analysis = compiled.memory_analysis()
        if analysis is None:  # a backend without memory analysis: assume a heavy piece
            return tokens * 4 * elements_per_token * _UNMEASURED_BUFFERS
        return analysis.temp_size_in_bytes

    growth = temporary_bytes(2 * probe_tokens) - temporary_bytes(probe_tokens)
    return max(growth / probe_tokens / (4 * max(elements_per_token, 1)), 1.0)


# What measure_buffers_per_element assumes where the backend cannot measure.
_UNMEASURED_BUFFERS = 16.0


def chunked_cross_entropy(
    token_log_probs: Callable[..., jax.Array],
    params: Any,
    hidden: jax.Array,
    labels: jax.Array,
    where: jax.Array | None = None,
    *,
    vocab_size: int,
    elements_per_token: int,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    buffers_per_element: float = 4.0,
    token_constants: Any = None,
    data_axis: str | None = None,
    prepare: Callable[[Any], Any] | None = None,
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
    When everything fits in ``memory_budget`` there is a single chunk and no loop. Chunks are
    contiguous runs of tokens read and written in place (the last one overlaps its
    predecessor instead of padding), so no copy of ``hidden`` or its gradient is made.

    Data parallelism: called inside ``jax.shard_map`` with each shard's own tokens and
    ``data_axis`` naming the mesh axis they are split over, the mask is normalized by the
    global count, every shard returns the global mean, and each shard accumulates its
    parameter gradients locally and reduces them over ``data_axis`` once per call (not once
    per chunk). Collectives of ``token_log_probs`` itself (a vocabulary-parallel normalizer)
    run per chunk.

    .. math:: \mathcal{L} = -\frac{1}{\sum_n w_n} \sum_n w_n \log p_\theta(y_n \mid h_n)

    Args:
      token_log_probs: pure function of ``(params, hidden [C, d], labels [C])`` returning ``[C]``;
        with ``token_constants`` it is called as ``(params, hidden, labels, constants)``.
      params: pytree of parameters (differentiable).
      hidden: ``[..., d]`` hidden states (differentiable).
      labels: ``[...]`` integer targets in ``[0, vocab_size)``.
      where: optional ``[...]`` boolean mask of the positions that count.
      vocab_size: ``M``, the number of classes (global, when the vocabulary is split); the
        labels are checked against it here, whatever ``token_log_probs`` does with them.
      elements_per_token: size of the per-token intermediate (``M``, ``K * M`` for a mixture;
        this shard's columns when the vocabulary is split).
      memory_budget: bytes one chunk may use (on this device).
      buffers_per_element: float32 buffers of ``[C, elements_per_token]`` one chunk's value and
        gradient keep live at once (see :func:`chunk_size_for_budget`; each head states its own).
      token_constants: optional pytree of per-token arrays ``[..., ...]`` (leading shape that of
        ``labels``) chunked alongside ``hidden`` but not differentiated, e.g. dropout masks.
      data_axis: inside ``shard_map``, the mesh axis the tokens are split over.
      prepare: optional differentiable map of ``params``, applied once per call outside the
        chunk loop; ``token_log_probs`` then receives ``prepare(params)``. For what every
        chunk would otherwise derive from the parameters again, e.g. a decoder's rows gathered
        into blocks: the gradients accumulate in the prepared layout and flow back through
        ``prepare`` once (one scatter per call, not one per chunk).

    Returns:
      Scalar mean NLL (float32), equal to ``cross_entropy(log_probs, labels, where)``.

    Raises:
      ValueError: bad shapes or dtypes, or concrete labels outside ``[0, vocab_size)`` (at
        masked positions too). Traced labels (under ``jit``, inside ``shard_map``) cannot be
        read: any out-of-range one, masked or not, makes the loss and every gradient NaN
        (on every shard), as :func:`cross_entropy` does.
    """
    require_float("hidden", hidden)
    require_ndim("hidden", hidden, 1, "[..., d]")
    # Before the conversion: without x64, jnp.asarray wraps int64 values into int32 silently.
    check_label_range(labels, vocab_size)
    labels = jnp.asarray(labels)
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape {hidden.shape[:-1]} (hidden {hidden.shape} without its "
            f"feature axis), got {labels.shape}"
        )
    if where is not None and jnp.shape(where) != labels.shape:
        raise ValueError(
            f"where must have shape {labels.shape} like labels, got {jnp.shape(where)}"
        )
    for constant in jax.tree.leaves(token_constants):
        if jnp.shape(constant)[: labels.ndim] != labels.shape:
            raise ValueError(
                f"token_constants must have leading shape {labels.shape} like labels, got "
                f"{jnp.shape(constant)}"
            )
    num_tokens = labels.size
    hidden_flat = hidden.reshape(num_tokens, hidden.shape[-1])
    labels_flat = labels.reshape(num_tokens).astype(jnp.int32)
    constants_flat = jax.tree.map(
        lambda c: jnp.reshape(c, (num_tokens, *jnp.shape(c)[labels.ndim :])), token_constants
    )
    mask = (
        jnp.ones((num_tokens,), bool)
        if where is None
        else jnp.asarray(where, bool).reshape(num_tokens)
    )
    count = jnp.sum(mask).astype(jnp.float32)
    if data_axis is not None:
        count = jax.lax.psum(count, data_axis)
    weights = mask.astype(jnp.float32) / jnp.maximum(count, 1.0)
    # Out-of-range labels (masked or not) anywhere, on any shard: counted once here, they make
    # the loss NaN through one scalar factor, whose cotangent (NaN) then scales every saved
    # gradient in the custom VJP, so no parameter gets a plausible update either.
    num_invalid = jnp.sum(~valid_labels(labels, vocab_size)).astype(jnp.float32)
    if data_axis is not None:
        num_invalid = jax.lax.psum(num_invalid, data_axis)
    chunk = chunk_size_for_budget(
        num_tokens, elements_per_token, memory_budget, buffers_per_element
    )
    if num_tokens == 0:  # one zero-weight token keeps the shapes valid
        pad = lambda x: jnp.pad(x, [(0, 1)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
        hidden_flat, labels_flat, weights = pad(hidden_flat), pad(labels_flat), pad(weights)
        constants_flat = jax.tree.map(pad, constants_flat)
    loss = _fused_weighted_nll(
        token_log_probs,
        chunk,
        data_axis,
        prepare,
        params,
        hidden_flat,
        labels_flat,
        weights,
        constants_flat,
    )
    return nan_unless(num_invalid == 0, loss)


def _chunk_at(xs: Any, index: jax.Array, chunk: int) -> Any:
    """Chunk ``index`` of the token-major pytree ``(hidden, labels, weights, constants)``.

    Chunks are contiguous windows read in place (no padded or reordered copy of the inputs).
    The last one ends at the last token and so may overlap its predecessor; the overlapping
    tokens get zero weight there, so every token counts once. Returns the window's first
    token and its arrays.
    """
    hidden, labels, weights, constants = xs
    num_tokens = hidden.shape[0]
    start = jnp.minimum(index * chunk, num_tokens - chunk)
    window = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk)  # noqa: E731
    fresh = start + jnp.arange(chunk) >= index * chunk
    weights = jnp.where(fresh, window(weights), jnp.zeros((), weights.dtype))
    return start, (window(hidden), window(labels), weights, jax.tree.map(window, constants))


def _call(token_log_probs: Callable[..., jax.Array], params, h, y, constants) -> jax.Array:
    args = (params, h, y) if constants is None else (params, h, y, constants)
    return token_log_probs(*args).astype(jnp.float32)


def _psum(x: jax.Array, axis: str | None) -> jax.Array:
    return x if axis is None else jax.lax.psum(x, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused_weighted_nll(
    token_log_probs, chunk, data_axis, prepare, params, hidden, labels, weights, constants
):
    if prepare is not None:
        params = prepare(params)

    def chunk_loss(xs):
        h, y, w, c = xs
        return -jnp.sum(w * _call(token_log_probs, params, h, y, c))

    xs = (hidden, labels, weights, constants)
    if hidden.shape[0] == chunk:
        return _psum(chunk_loss(xs), data_axis)
    num_chunks = -(-hidden.shape[0] // chunk)
    losses = jax.lax.map(lambda i: chunk_loss(_chunk_at(xs, i, chunk)[1]), jnp.arange(num_chunks))
    return _psum(jnp.sum(losses), data_axis)


def _fused_weighted_nll_fwd(
    token_log_probs, chunk, data_axis, prepare, params, hidden, labels, weights, constants
):
    # Parameters replicated over the data axis are marked as varying, so each shard's gradient
    # stays its own partial sum through the chunk loop; one psum at the end combines them.
    local_params = params
    if data_axis is not None:
        local_params = jax.tree.map(lambda p: mark_varying(p, (data_axis,)), params)
    if prepare is not None:
        local_params, pull_back = jax.vjp(prepare, local_params)

    def value_and_grads(h, y, w, c):
        def weighted_nll(p, h):
            return -jnp.sum(w * _call(token_log_probs, p, h, y, c))

        return jax.value_and_grad(weighted_nll, argnums=(0, 1))(local_params, h)

    if hidden.shape[0] == chunk:
        loss, (grad_params, grad_hidden) = value_and_grads(hidden, labels, weights, constants)
    else:

        def step(carry, index):
            grad_params, grad_hidden = carry
            start, chunk_xs = _chunk_at(xs, index, chunk)
            chunk_loss, (chunk_grad_params, chunk_grad_hidden) = value_and_grads(*chunk_xs)
            grad_params = jax.tree.map(
                lambda acc, g: acc + g.astype(jnp.float32), grad_params, chunk_grad_params
            )
            # Added, not written: the last chunk's overlap carries zero gradient.
            previous = jax.lax.dynamic_slice_in_dim(grad_hidden, start, chunk)
            grad_hidden = jax.lax.dynamic_update_slice_in_dim(
                grad_hidden, previous + chunk_grad_hidden, start, axis=0
            )
            return (grad_params, grad_hidden), chunk_loss

        def zeros(x: jax.Array, dtype: Any) -> jax.Array:
            return mark_varying(jnp.zeros(jnp.shape(x), dtype), varying_axes(x))

        xs = (hidden, labels, weights, constants)
        init = (
            jax.tree.map(lambda p: zeros(p, jnp.float32), local_params),
            zeros(hidden, hidden.dtype),
        )
        num_chunks = -(-hidden.shape[0] // chunk)
        (grad_params, grad_hidden), losses = jax.lax.scan(step, init, jnp.arange(num_chunks))
        loss = jnp.sum(losses)
    if prepare is not None:
        (grad_params,) = pull_back(
            jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grad_params, local_params)
        )
    grad_params = jax.tree.map(
        lambda g, p: reduce_like(g, p).astype(jnp.result_type(p)), grad_params, params
    )
    return _psum(loss, data_axis), (grad_params, grad_hidden)


def _fused_weighted_nll_bwd(token_log_probs, chunk, data_axis, prepare, residuals, cotangent):
    grad_params, grad_hidden = residuals
    scale = cotangent.astype(jnp.float32)
    return (
        jax.tree.map(lambda g: (scale * g.astype(jnp.float32)).astype(g.dtype), grad_params),
        (scale * grad_hidden.astype(jnp.float32)).astype(grad_hidden.dtype),
        None,
        None,
        None,
    )


_fused_weighted_nll.defvjp(_fused_weighted_nll_fwd, _fused_weighted_nll_bwd)
