r"""What a rank-``d`` output layer implies beyond the rank of its log-probabilities.

Three diagnostics of a head ``z = W h + b`` with ``W`` ``[M, d]``, ``d < M``:

* :func:`unargmaxable_tokens`: tokens that no hidden state makes the argmax (Demeter et al. 2020,
  "Stolen Probability"; Grivas et al. 2022, "Low-Rank Softmax Can Have Unargmaxable Classes in
  Theory but Rarely in Practice"), decided exactly by one small linear program per token;
* :func:`estimate_hidden_size`: ``d`` read off a stack of output distributions (Finlayson et al.
  2024, "Logits of API-Protected LLMs Leak Proprietary Information"; Carlini et al. 2024,
  "Stealing Part of a Production Language Model");
* :func:`gradient_bottleneck_ratio`, :func:`jacobian_gradient_ratio`,
  :func:`head_gradient_ratio`: the share of the logit gradient's norm that the head passes back
  to its input (Godey & Artzi 2026, "Lost in Backpropagation: The LM Head is a Gradient
  Bottleneck").

The first two are host-side (NumPy / SciPy, float64): they answer yes/no and integer questions
whose tolerances are easier to state in float64. The gradient ratios are JAX and jittable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bottleneck._checks import (
    compute_dtype,
    require_finite_number,
    require_float,
    require_ndim,
)


def _host_array(name: str, x: Any, ndim: int, shape_doc: str) -> np.ndarray:
    """``x`` as a finite float64 NumPy array of ``ndim`` dimensions; ``ValueError`` naming it."""
    array = np.asarray(x)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name} must have a floating dtype, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_doc}, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite (it holds NaN or inf)")
    return array.astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Unargmaxable tokens


def _margins(W: np.ndarray, b: np.ndarray, tokens: np.ndarray, h: np.ndarray, s: np.ndarray):
    """``[B, M]`` margins ``(w_i - w_j)^T h + s (b_i - b_j)`` of each token ``i`` over each ``j``
    (``+inf`` at ``j = i``)."""
    z = h @ W.T + s[:, None] * b
    margins = z[np.arange(len(tokens)), tokens][:, None] - z
    margins[np.arange(len(tokens)), tokens] = np.inf
    return margins


def _margin_lp(W, b, i, rows, bounded):
    """max t s.t. (w_j - w_i)^T h + s (b_j - b_i) + t <= 0 for j in rows; h in [-1, 1]^d,
    s in [0, 1] (no bound) or s = 1 (bound). Returns (t, h, s)."""
    d = W.shape[1]
    A = np.hstack([W[rows] - W[i], (b[rows] - b[i])[:, None], np.ones((len(rows), 1))])
    bounds = [(-1.0, 1.0)] * d + [(1.0, 1.0) if bounded else (0.0, 1.0), (None, 2.0)]
    cost = np.zeros(d + 2)
    cost[-1] = -1.0
    from scipy.optimize import linprog  # here: importing it costs every user of the package 0.6 s

    result = linprog(cost, A_ub=A, b_ub=np.zeros(len(rows)), bounds=bounds, method="highs")
    if result.status != 0:  # cannot happen for this bounded, feasible (h = 0, t <= 0) program
        raise RuntimeError(f"linprog failed for token {i}: {result.message}")
    return -result.fun, result.x[:d], result.x[d]


def unargmaxable_tokens(
    W: Any,
    b: Any = None,
    *,
    bound: float | None = None,
    tol: float = 1e-6,
    filter_steps: int = 20,
    chunk_size: int = 256,
) -> np.ndarray:
    r"""Sorted indices of the tokens that no hidden state makes the strict argmax of ``W h + b``.

    Token ``i`` is *argmaxable* when some ``h`` gives it the largest logit strictly:
    :math:`(w_i - w_j)^\top h + b_i - b_j > 0` for every ``j != i`` (Demeter et al. 2020, §3;
    Grivas et al. 2022, §3). With the logits normalised by a common scale (which moves no argmax),
    the decision is the linear program

    .. math::
       t^\star_i = \max_{h,\,s,\,t}\; t \quad\text{s.t.}\quad
       (w_i - w_j)^\top h + s\,(b_i - b_j) \ge t \;\;\forall j \ne i,\qquad
       h \in [-1, 1]^d

    and ``i`` is argmaxable iff :math:`t^\star_i > \text{tol}`. Without ``bound``, ``s`` ranges
    over ``[0, 1]`` (homogenised: ``(h, s)`` with ``s > 0`` is the hidden state ``h / s``, ``s = 0``
    a direction ``u`` along which ``\lambda u`` wins for large ``\lambda``), so the box loses
    nothing: the scale of ``h`` is free. Then, without a bias, ``i`` is argmaxable iff ``w_i`` is a
    vertex of the convex hull of the rows of ``W`` (and no other row equals it); a bias cannot
    demote a vertex (for large ``h`` the bias is negligible) but can rescue a token inside the hull
    (``W = [[-1], [0], [1]]``, ``b = [0, 1, 0]``: token 1 wins at ``h = 0``). With ``bound``, ``s = 1``
    and ``h`` is confined to the box :math:`\|h\|_\infty \le \text{bound}` (the bounded input space
    of Grivas et al.): a large negative bias can then make a hull vertex unargmaxable. The box
    contains the Euclidean ball of radius ``bound`` and lies inside the one of radius
    :math:`\text{bound}\sqrt d`; a ball is not a linear constraint.

    Speed: a vectorised pre-filter first tries, for every token, the hidden state
    ``w_i - mean(W)`` and ``filter_steps`` perceptron steps towards the strongest rival (float64
    margins ``> tol`` are a certificate). The rest go to the LP by cutting planes: it starts from
    the ``4 (d + 1)`` strongest rivals at the filter's ``h`` and adds the most violated rivals until
    the relaxed optimum either wins against all ``M`` tokens (argmaxable) or has
    ``t <= tol`` (a relaxation with fewer rivals bounds ``t*`` from above: unargmaxable). Each LP
    is solved by SciPy's HiGHS.

    Example:
      >>> import numpy as np, bottleneck as bn
      >>> square = np.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0], [0.2, 0.1]])
      >>> bn.unargmaxable_tokens(square).tolist()  # the point inside the square
      [4]
      >>> bn.unargmaxable_tokens(square, np.array([0.0, 0.0, 0.0, 0.0, 1.0])).tolist()
      []

    Args:
      W: ``[M, d]`` decoder (rows are token embeddings), finite.
      b: ``[M]`` output bias, or ``None``.
      bound: ``None`` (any ``h`` in ``R^d``) or a finite number ``> 0``: ``||h||_inf <= bound``.
      tol: margin (relative to the largest ``|w_j^T h| + |b_j|`` over the allowed ``h``) at or
        below which a token counts as unargmaxable; HiGHS solves to about ``1e-7``.
      filter_steps: perceptron steps of the pre-filter (``0``: the LP decides every token the
        first guess does not).
      chunk_size: tokens per vectorised filter step (memory ``chunk_size x M`` floats).

    Returns:
      ``[K]`` int64 sorted token indices, ``K = 0`` when every token can win.
    """
    W = _host_array("W", W, 2, "[M, d]")
    M, d = W.shape
    if M < 1 or d < 1:
        raise ValueError(f"W must have shape [M, d] with M, d >= 1, got {W.shape}")
    b = np.zeros(M) if b is None else _host_array("b", b, 1, "[M]")
    if b.shape != (M,):
        raise ValueError(f"b must have shape [M] = [{M}], got {b.shape}")
    bounded = bound is not None
    if bounded:
        bound = require_finite_number("bound", bound, positive=True)
    tol = require_finite_number("tol", tol, positive=True)
    if M == 1:
        return np.zeros(0, np.int64)
    # One scale for W and b moves no argmax; afterwards |w_j^T h| + |s b_j| <= 1 on the box.
    W = W * (bound if bounded else 1.0)
    scale = max(np.abs(W).sum(1).max(), np.abs(b).max())
    if scale == 0:
        return np.arange(M, dtype=np.int64)  # every logit is 0 everywhere: all tied
    W, b = W / scale, b / scale

    # Pre-filter: vectorised over chunks of tokens.
    decided = np.zeros(M, bool)
    start_h = np.zeros((M, d))
    for first in range(0, M, chunk_size):
        tokens = np.arange(first, min(first + chunk_size, M))
        h = W[tokens] - W.mean(0)
        h /= np.maximum(np.abs(h).max(1, keepdims=True), 1e-300)
        s = np.ones(len(tokens))
        for step in range(filter_steps + 1):
            margins = _margins(W, b, tokens, h, s)
            wins = margins.min(1) > tol
            decided[tokens[wins]] = True
            if step == filter_steps or wins.all():
                break
            rival = margins.argmin(1)
            h = np.clip(h + 0.5 * (W[tokens] - W[rival]), -1.0, 1.0)
            if not bounded:
                s = np.clip(s + 0.5 * (b[tokens] - b[rival]), 0.0, 1.0)
        start_h[tokens] = h

    # Exact decision for the rest: the LP by cutting planes.
    unargmaxable = []
    batch = 4 * (d + 1)
    for i in np.flatnonzero(~decided):
        token = np.array([i])
        margins = _margins(W, b, token, start_h[i : i + 1], np.ones(1))[0]
        rows = np.argsort(margins)[: min(batch, M - 1)]
        while True:
            t, h, s = _margin_lp(W, b, i, rows, bounded)
            if t <= tol:
                unargmaxable.append(i)
                break
            margins = _margins(W, b, token, h[None], np.array([s]))[0]
            if margins.min() > tol:
                break
            margins[rows] = np.inf
            new = np.argsort(margins)[:batch]
            new = new[margins[new] < t]
            if len(new) == 0:  # all violated rivals already in: t is the LP's round-off
                break
            rows = np.concatenate([rows, new])
    return np.asarray(unargmaxable, np.int64)


# ---------------------------------------------------------------------------------------------
# Hidden size from output distributions


def estimate_hidden_size(log_probs: Any, *, tol: float | None = None) -> int:
    r"""The hidden size ``d`` of a softmax head, from a stack of its full log-probability rows.

    A softmax head gives :math:`\log p_n = W h_n + b - \log Z_n \mathbf 1`. Centring each row over
    the vocabulary (:math:`C_M = I - \mathbf 1 \mathbf 1^\top / M`) removes :math:`\log Z_n`, and
    centring the columns over the ``N`` rows (:math:`C_N`) removes the bias:

    .. math:: Y = C_N \,[\log p_n]_{n}\, C_M = C_N H W^\top C_M, \qquad \operatorname{rank} Y = d

    when the hidden states span ``R^d`` and ``1`` is not in the column space of ``W``
    (Finlayson et al. 2024, §3: outputs lie in a ``d``-dimensional subspace after the clr
    transform; Carlini et al. 2024, §4.1: the singular values of stacked logits drop after ``d``).
    This returns the number of singular values of ``Y`` above ``tol``, by default the largest
    amount the round-off of the input can move any of them:

    .. math:: \text{tol} = \epsilon_{\text{dtype}}\, \lVert \log p \rVert_F

    (:math:`\epsilon` of the input's dtype, float32's for lower precisions). Entries accurate to
    their dtype are off by :math:`E` with :math:`\lVert E\rVert_F \le \epsilon \lVert \log p
    \rVert_F`; centring projects orthogonally on both sides, so by Weyl's inequality no singular
    value of ``Y`` moves by more. The round-off of float32 log-probs computed by a softmax stays
    10–60 times below this bound in the tests, and a trained head's hidden states may barely vary
    along some of their ``d`` directions: in the converged study's softmax head at d = 128
    (2,048 positions, 10,000 words) the smallest signal singular value is 6 times the bound, the
    round-off 1/46 of it. (Numerical Recipes' threshold
    :math:`\tfrac12\sqrt{N+M+1}\,\sigma_{\max}\,\epsilon`, used here before, bounds an SVD's
    own round-off, done here in float64; 55 times larger there, it found 123 of the 128.) The
    answer is at most ``min(N, M) - 1``, which is what a full-rank stack gives: ``N >= d + 2``
    rows are needed to see ``d``, and an answer equal to ``N - 1`` means "at least".

    Example:
      >>> import numpy as np, bottleneck as bn
      >>> rng = np.random.default_rng(0)
      >>> logits = rng.normal(size=(40, 6)) @ rng.normal(size=(6, 100)) + rng.normal(size=100)
      >>> log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
      >>> bn.estimate_hidden_size(log_probs)
      6

    Args:
      log_probs: ``[N, M]`` finite log-probabilities (or logits), ``N, M >= 2``.
      tol: absolute threshold on the singular values of ``Y``; ``None`` for the default above.

    Returns:
      The estimated ``d`` as a Python ``int``.
    """
    array = np.asarray(log_probs)
    dtype = array.dtype
    x = _host_array("log_probs", array, 2, "[N, M]")
    N, M = x.shape
    if N < 2 or M < 2:
        raise ValueError(f"log_probs must have shape [N, M] with N, M >= 2, got {x.shape}")
    y = x - x.mean(1, keepdims=True)
    y -= y.mean(0, keepdims=True)
    s = np.linalg.svd(y, compute_uv=False)
    if tol is None:
        eps = np.finfo(dtype if np.finfo(dtype).bits >= 32 else np.float32).eps
        tol = eps * np.linalg.norm(x)  # Frobenius
    else:
        tol = require_finite_number("tol", tol, positive=False)
    return int(np.sum(s > tol))


# ---------------------------------------------------------------------------------------------
# The gradient bottleneck


def _projected_share(basis: jax.Array, g: jax.Array) -> jax.Array:
    """``||P g|| / ||g||`` with ``P`` the orthogonal projector onto the column space of
    ``basis [..., M, d]`` (numerical rank, Numerical Recipes tolerance), 0 where ``g = 0``."""
    u, s, _ = jnp.linalg.svd(basis, full_matrices=False)
    m, n = basis.shape[-2:]
    tol = 0.5 * (m + n + 1) ** 0.5 * s[..., :1] * jnp.finfo(s.dtype).eps
    coefficients = jnp.einsum("...md,...m->...d", u, g) * (s > tol).astype(s.dtype)
    norm = jnp.linalg.norm(g, axis=-1)
    projected = jnp.linalg.norm(coefficients, axis=-1)
    return jnp.where(norm > 0, projected / jnp.where(norm > 0, norm, 1), 0).astype(norm.dtype)


def gradient_bottleneck_ratio(W: jax.Array, g: jax.Array) -> jax.Array:
    r"""Share of a logit gradient's norm that a linear head ``z = W h + b`` passes to ``h``.

    The gradient reaching ``h`` is :math:`W^\top g = W^\top P_W g`: only the projection of ``g``
    onto the column space of ``W`` survives, the rest is lost (Godey & Artzi 2026, §3; they
    measure 95-99% of the norm lost in trained LMs). This returns

    .. math:: r = \frac{\lVert P_W g \rVert_2}{\lVert g \rVert_2} \in [0, 1], \qquad
       P_W = U_r U_r^\top

    with :math:`U_r` the left singular vectors of ``W`` above ``bn.numerical_rank``'s tolerance.
    ``r = 1`` when ``W`` has rank ``M`` (``M <= d``); for ``g`` isotropic at random,
    :math:`\mathbb E\, r^2 = \operatorname{rank} W / M`, so ``r`` is about :math:`\sqrt{d / M}`.
    For softmax cross-entropy ``g = p - e_y``. Rows with ``g = 0`` give 0.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> W = jnp.array([[1.0], [0.0]])  # M = 2, d = 1: h sees the first logit only
      >>> bn.gradient_bottleneck_ratio(W, jnp.array([3.0, 4.0])).item()
      0.6...

    Args:
      W: ``[M, d]`` decoder.
      g: ``[..., M]`` gradients of a loss with respect to the logits.

    Returns:
      ``[...]`` ratios, dtype at least float32.
    """
    require_float("W", W)
    require_float("g", g)
    if jnp.ndim(W) != 2:
        raise ValueError(f"W must have shape [M, d], got shape {jnp.shape(W)}")
    require_ndim("g", g, 1, "[..., M]")
    if jnp.shape(g)[-1] != jnp.shape(W)[0]:
        raise ValueError(
            f"g must have shape [..., M] with M = {jnp.shape(W)[0]}, got {jnp.shape(g)}"
        )
    dtype = compute_dtype(W, g)
    return _projected_share(jnp.asarray(W).astype(dtype), jnp.asarray(g).astype(dtype))


def jacobian_gradient_ratio(
    logits_fn: Callable[[jax.Array], jax.Array], h: jax.Array, g: jax.Array
) -> jax.Array:
    r""":func:`gradient_bottleneck_ratio` for any head: ``g`` projected on the Jacobian's columns.

    For a head ``z = f(h)`` the gradient reaching ``h`` is :math:`J^\top g` with
    :math:`J = \partial f / \partial h` ``[M, d]`` at ``h``; the part of ``g`` that can reach ``h`` is
    its projection onto the column space of ``J``:

    .. math:: r(h, g) = \frac{\lVert P_{J(h)}\, g \rVert_2}{\lVert g \rVert_2}

    For a linear head ``J = W`` and this is :func:`gradient_bottleneck_ratio`. For a nonlinear head
    (PLIF, sigsoftmax scores: ``J = \operatorname{diag}(f'(z)) W``) it is the same local quantity at
    each ``h``: which share of ``g`` the head's linearisation can pass back. ``J`` is built with
    ``d`` forward-mode products (``jax.jacfwd``), ``M x d`` floats per hidden state.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> W = jnp.array([[1.0], [0.0]])
      >>> bn.jacobian_gradient_ratio(lambda h: W @ h, jnp.ones(1), jnp.array([3.0, 4.0])).item()
      0.6...

    Args:
      logits_fn: maps one hidden state ``[d]`` to outputs ``[M]``.
      h: ``[..., d]`` hidden states.
      g: ``[..., M]`` gradients of a loss with respect to ``logits_fn(h)``.

    Returns:
      ``[...]`` ratios in ``[0, 1]``.
    """
    require_float("h", h)
    require_float("g", g)
    require_ndim("h", h, 1, "[..., d]")
    require_ndim("g", g, 1, "[..., M]")
    if jnp.shape(h)[:-1] != jnp.shape(g)[:-1]:
        raise ValueError(
            f"h [..., d] and g [..., M] must share their batch shape, got {jnp.shape(h)} and "
            f"{jnp.shape(g)}"
        )
    batch = jnp.shape(h)[:-1]
    flat_h = jnp.reshape(h, (-1, jnp.shape(h)[-1]))
    flat_g = jnp.reshape(g, (-1, jnp.shape(g)[-1]))
    jacobians = jax.vmap(jax.jacfwd(logits_fn))(flat_h)
    if jacobians.shape[1:] != (flat_g.shape[-1], flat_h.shape[-1]):
        raise ValueError(
            f"logits_fn must map [d] to [M] = [{flat_g.shape[-1]}]; its Jacobians have shape "
            f"{jacobians.shape[1:]}"
        )
    dtype = compute_dtype(jacobians, flat_g)
    ratios = _projected_share(jacobians.astype(dtype), flat_g.astype(dtype))
    return jnp.reshape(ratios, batch)


def head_gradient_ratio(
    head: Any, h: jax.Array, labels: jax.Array, *, batch_size: int | None = None
) -> jax.Array:
    r""":func:`jacobian_gradient_ratio` of an :class:`~bottleneck.nn.OutputHead` under its own loss.

    A plain head's log-probabilities are :math:`\mathrm{log\_softmax}(s)` of its scores
    :math:`s = \log g(f(W h + b))` (``head.log_scores(head.logits(h))``; ``s = z`` for softmax), so
    the cross-entropy's gradient with respect to the scores is :math:`g = \mathrm{softmax}(s) -
    e_y`, and this returns :math:`\lVert P_{\partial s / \partial h}\, g \rVert / \lVert g
    \rVert`. For a softmax head it equals ``gradient_bottleneck_ratio(W, p - e_y)`` (Godey &
    Artzi's measure). A mixture (MoS, Mixtape) has no single score vector; its scores are then
    its log-probabilities :math:`s = \log p(h)` themselves (``log_softmax(s) = s``), so again
    :math:`g = p - e_y`, projected on the columns of :math:`\partial \log p / \partial h`.

    A plain head's Jacobian is built as :math:`\operatorname{diag}(s'(z))\, W` (its score map is
    elementwise), so pieces with a custom VJP such as PLIF work; a mixture's goes through
    ``jax.jacfwd`` of its log-probabilities (``d`` forward-mode products), which such pieces do
    not support.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> from flax import nnx
      >>> from bottleneck import nn
      >>> head = nn.OutputHead(4, 50, rngs=nnx.Rngs(0))
      >>> bn.head_gradient_ratio(head, jnp.ones((3, 4)), jnp.array([0, 1, 2])).shape
      (3,)

    Args:
      head: an ``OutputHead`` (plain or mixture, including ``MixtapeHead``).
      h: ``[..., d]`` hidden states.
      labels: ``[...]`` integer targets in ``[0, M)``.
      batch_size: positions measured at once (``jax.lax.map`` over them; each holds a
        ``[M, d]`` Jacobian); None: all at once.

    Returns:
      ``[...]`` ratios in ``[0, 1]``.
    """
    if batch_size is not None:
        ratios = jax.lax.map(
            lambda position: head_gradient_ratio(head, *position),
            (h.reshape(-1, h.shape[-1]), labels.reshape(-1)),
            batch_size=batch_size,
        )
        return ratios.reshape(labels.shape)
    vocab = head.vocab_size
    if head.is_mixture:
        log_p = head(h)
        g = jnp.exp(log_p) - jax.nn.one_hot(labels, vocab, dtype=log_p.dtype)
        return jacobian_gradient_ratio(head, h, g)
    s, pullback = jax.vjp(head.log_scores, head.logits(h))
    # log_scores is elementwise, so pulling back ones gives its Jacobian's diagonal: J = diag(s') W
    # exactly, also for pieces with a custom VJP (PLIF) that forward-mode jacfwd cannot go through.
    (slopes,) = pullback(jnp.ones_like(s))
    s, slopes = s[..., :vocab], slopes[..., :vocab]
    g = jax.nn.softmax(s, axis=-1) - jax.nn.one_hot(labels, vocab, dtype=s.dtype)
    decoder = head.decoder[...][:vocab].astype(s.dtype)
    return _projected_share(slopes[..., :, None] * decoder, g)
