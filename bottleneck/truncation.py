r"""Basis-aware truncation (BAT): which tokens a softmax head's output proves to be possible.

Finlayson, Hewitt, Koller, Swayamdipta and Sabharwal (ICLR 2024, "Closing the Curious Case of
Neural Text Degeneration"). Two facts about a softmax head ``p = softmax(W h + b)`` trained by
cross-entropy against a true distribution ``p*``:

* (§3, the threshold view) if the model never under-estimates a true probability by more than a
  factor :math:`e^{\delta}` (:math:`p^*_j \le e^{\delta} \hat p_j`), every token with
  :math:`\hat p_i \ge \tau = 1 - e^{-\delta}` has :math:`p^*_i > 0`: the rest can outweigh
  ``1`` only if token ``i`` has some mass;
* (§4, the softmax bottleneck) at a stationary point of the cross-entropy in ``h``,
  :math:`\nabla_h = W^\top (\hat p - p^*) = 0`: the true distribution has the model's moments
  :math:`W^\top p^* = W^\top \hat p` (an output bias does not enter: it is not a function of ``h``).

BAT keeps token ``i`` unless some distribution consistent with both facts gives it zero:
:func:`bat_keep_mask` decides this with one linear program per token. Host-side (SciPy HiGHS):
:func:`bottleneck.generate` uses it with ``bat_tau``, solving programs only for the tokens it
draws.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from bottleneck._checks import require_finite_number


def _best_dual_gap(p: np.ndarray, r: np.ndarray, i: int, c: float) -> float:
    r"""min over ``t`` of :math:`\varphi(t) = \sum_{j \ne i} \hat p_j (c (r_j - t)_+ + (t - r_j)_+)
    - \hat p_i (r_i - t)`, relative to :math:`\sum_j \hat p_j |r_j - t|` at the minimiser
    (a piecewise-linear convex function: its minimum lies at a breakpoint ``t = r_j``)."""
    others = np.delete(np.arange(len(p)), i)
    order = others[np.argsort(r[others])]
    rj, pj = r[order], p[order]
    below_p, below_pr = np.cumsum(pj), np.cumsum(pj * rj)
    total_p, total_pr = below_p[-1], below_pr[-1]
    above = (total_pr - below_pr) - rj * (total_p - below_p)  # sum over r_j > t of p_j (r_j - t)
    below = rj * below_p - below_pr  # sum over r_j <= t of p_j (t - r_j)
    phi = c * above + below - p[i] * (r[i] - rj)
    k = int(np.argmin(phi))
    size = above[k] + below[k] + p[i] * abs(r[i] - rj[k])
    return float(phi[k] / size) if size > 0 else 0.0


def bat_keep_mask(log_probs: Any, W: Any, *, tau: float, tokens: Any = None) -> np.ndarray:
    r"""Which tokens basis-aware truncation keeps: those no consistent true distribution can zero.

    With :math:`\hat p = \exp(\text{log\_probs})` (renormalised in float64) and ``W`` the head's
    ``[M, d]`` decoder, token ``i`` is discarded iff the polytope

    .. math::
       \{\, p \in \mathbb R^M :\; W^\top p = W^\top \hat p,\;\; \mathbf 1^\top p = 1,\;\;
       0 \le p \le \hat p / (1 - \tau),\;\; p_i = 0 \,\}

    is non-empty (Finlayson et al. 2024, §4, with §3's bound :math:`p^* \le e^{\delta}\hat p` at
    :math:`\tau = 1 - e^{-\delta}`). Shortcuts, both exact: :math:`\hat p_i \ge \tau` is always
    kept (§3: the other tokens' caps sum to less than 1), and a *dual certificate* keeps ``i``
    without a program: by Farkas' lemma the polytope is empty iff some :math:`y = (v, \theta)` has

    .. math::
       \hat p_i s_i > \sum_{j \ne i} \hat p_j \bigl(c\, (s_j)_+ + (-s_j)_+\bigr), \quad
       s_j = v^\top w_j + \theta,\;\; c = \tau / (1 - \tau)

    which is tried along ``v = w_i - W^\top \hat p`` and ``v = w_i`` with the best ``theta`` (a
    sort). Otherwise HiGHS decides the program, in the variables :math:`x_j = p_j / \hat p_j`; a
    solver failure keeps the token (as the authors do). With ``W = 0`` BAT is the threshold rule
    :math:`\hat p_i > \tau`; ``p >= 0`` is imposed (the authors' README sketch omits it, which
    discards more).

    Cost: a program has ``M`` variables and ``d + 1`` equality rows; at ``M = 10,000``,
    ``d = 128`` a hard one took about 35 s on 2 CPU cores, so decide the few tokens you need
    (``tokens``), as :func:`bottleneck.generate` does, rather than the whole vocabulary. Before
    any program, a primal certificate (:class:`BatProblem`) discards a token cheaply where
    alternating projections find a consistent distribution without it; Ctrl-C interrupts a
    program.

    Example (``W = 0``: the threshold rule):
      >>> import numpy as np, bottleneck as bn
      >>> log_p = np.log([0.6, 0.3, 0.08, 0.02])
      >>> bn.bat_keep_mask(log_p, np.zeros((4, 2)), tau=0.05).tolist()
      [True, True, True, False]

    Args:
      log_probs: ``[M]`` log-probabilities of one next-token distribution (``-inf`` allowed).
      W: ``[M, d]`` decoder of the softmax head that produced them (the bias is not needed).
      tau: threshold in ``(0, 1)``.
      tokens: ``None`` (all ``M``) or integer ids in ``[0, M)`` to decide.

    Returns:
      bool ``[M]`` (or ``[len(tokens)]``): ``True`` where the token is kept.
    """
    log_p = np.asarray(log_probs)
    if not np.issubdtype(log_p.dtype, np.floating) or log_p.ndim != 1:
        raise ValueError(
            f"log_probs must be a floating [M] vector, got {log_p.dtype} of shape {log_p.shape}"
        )
    if np.any(np.isnan(log_p)) or np.any(log_p == np.inf) or np.all(log_p == -np.inf):
        raise ValueError("log_probs must hold no NaN or +inf and not be all -inf")
    M = log_p.shape[0]
    W = np.asarray(W)
    if not np.issubdtype(W.dtype, np.floating) or W.ndim != 2 or W.shape[0] != M:
        raise ValueError(f"W must be a floating [M, d] = [{M}, d] matrix, got shape {W.shape}")
    if not np.all(np.isfinite(W)):
        raise ValueError("W must be finite (it holds NaN or inf)")
    tau = require_finite_number("tau", tau, positive=True)
    if tau >= 1:
        raise ValueError(f"tau must be in (0, 1), got {tau}")
    if tokens is None:
        tokens = np.arange(M)
    else:
        tokens = np.asarray(tokens)
        if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array of integer ids, got {tokens!r}")
        if np.any(tokens < 0) or np.any(tokens >= M):
            raise ValueError(f"tokens must lie in [0, {M})")
    problem = BatProblem(log_p, W, tau)
    return np.array([problem.keep(int(i)) for i in tokens], bool)


# Dykstra iterations of the primal certificate before a linear program decides instead: each is
# two passes over [M, d + 1], milliseconds where a program takes seconds at M = 10,000.
PRIMAL_ITERATIONS = 50


class BatProblem:
    r"""Basis-aware truncation's decisions for one distribution, token by token
    (:func:`bat_keep_mask`'s work, shared across the tokens asked about).

    ``keep(i)`` tries, cheapest first, each an exact decision: the threshold
    (:math:`\hat p_i \ge \tau` keeps), a dual certificate (keeps: Farkas, along two directions),
    a primal certificate (discards: a point of the polytope with :math:`p_i = 0`, found by
    alternating projections from the least-squares move of token ``i``'s mass onto the others,
    :meth:`_moved_mass_fits`), and only then HiGHS's linear program, run in a worker thread
    so that Ctrl-C stops the caller at once (the program finishes in the background).
    ``programs`` counts the programs solved. The moments' Gram matrix is computed once, when a
    token first needs it.
    """

    def __init__(self, log_probs: np.ndarray, W: np.ndarray, tau: float) -> None:
        log_p = np.asarray(log_probs, np.float64)
        p = np.exp(log_p - log_p.max())
        self.p = p / p.sum()
        self.W = np.asarray(W, np.float64)
        self.tau, self.c = tau, tau / (1 - tau)
        self.programs = 0

    # Computed when a token below tau first needs them: most drawn tokens are kept at once.
    @functools.cached_property
    def mean(self) -> np.ndarray:
        return self.W.T @ self.p

    @functools.cached_property
    def a(self) -> np.ndarray:
        """``a_j = (w_j, 1)``: a token's moments and its mass, ``[M, d + 1]``."""
        return np.hstack([self.W, np.ones((len(self.p), 1))])

    @functools.cached_property
    def gram(self) -> np.ndarray:
        """``sum_j p_hat_j a_j a_j^T``, ``[d + 1, d + 1]``."""
        return (self.a * self.p[:, None]).T @ self.a

    def keep(self, i: int) -> bool:
        p, tau = self.p, self.tau
        if p[i] >= tau:
            return True
        if p[i] == 0:
            return False  # x = 1 elsewhere is feasible
        if any(
            _best_dual_gap(p, self.W @ v, i, self.c) < -1e-9
            for v in (self.W[i] - self.mean, self.W[i])
        ):
            return True
        if self._moved_mass_fits(i):
            return False
        return not self._program_feasible(i)

    def _moved_mass_fits(self, i: int) -> bool:
        r"""The primal certificate: ``True`` where a point of the polytope with ``p_i = 0`` is
        found. In ``y = x - 1`` the polytope is the affine set
        :math:`\sum_{j \ne i} \hat p_j y_j a_j = \hat p_i a_i` cut by the box
        :math:`-1 \le y_j \le c`; Dykstra's alternating projections (the affine one in the
        metric ``diag(p_hat)``, through the Gram matrix without token ``i``) start from the
        least-squares move and stop at :data:`PRIMAL_ITERATIONS` or at a box point whose moments
        match to ``1e-9`` of their scale: that point is the certificate."""
        a, c = self.a, self.c
        weights = self.p.copy()
        weights[i] = 0.0  # token i is not a variable: y_i = -1, moved to the right-hand side
        target = self.p[i] * a[i]
        inverse = np.linalg.pinv(self.gram - self.p[i] * np.outer(a[i], a[i]))
        scale = (np.abs(a) * weights[:, None]).sum(0) + self.p[i] * np.abs(a[i]) + 1e-300
        y, affine_step, box_step = np.zeros(len(a)), np.zeros(len(a)), np.zeros(len(a))
        for _ in range(PRIMAL_ITERATIONS):
            z = y + affine_step
            projected = z - a @ (inverse @ (a.T @ (weights * z) - target))
            affine_step = z - projected
            z = projected + box_step
            y = np.clip(z, -1.0, c)
            box_step = z - y
            if np.all(np.abs(a.T @ (weights * y) - target) <= 1e-9 * scale):
                return True
        return False

    def _program_feasible(self, i: int) -> bool:
        """HiGHS: is there a consistent distribution with ``p_i = 0``? (in ``x_j = p_j / p_hat_j``;
        a solver failure counts as infeasible, so the token is kept, as the authors do)."""
        M = len(self.p)
        columns = self.a.T * self.p
        upper = np.full(M, 1 / (1 - self.tau))
        upper[i] = 0.0
        outcome: dict[str, Any] = {}
        from scipy.optimize import linprog  # here: importing it costs every user 0.6 s

        def solve() -> None:
            outcome["status"] = linprog(
                np.zeros(M), A_eq=columns, b_eq=columns.sum(1), bounds=np.c_[np.zeros(M), upper],
                method="highs",
            ).status  # fmt: skip

        worker = threading.Thread(target=solve, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.1)  # the main thread stays interruptible (HiGHS releases the GIL)
        self.programs += 1
        return outcome.get("status") == 0  # 0: a feasible p with p_i = 0 exists
