"""Paired statistics for comparing a head with softmax over seeds: the paired t interval, Holm's
correction over a grid of comparisons, the power of a paired design, and a gain's trend in log d.

Every function is plain NumPy / SciPy on a handful of numbers (one per seed or per width); the
study's report (:mod:`bottleneck.runs.lm_study_report`) applies them to its rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# scipy.stats and scipy.optimize are imported by the functions that use them: at the top they
# would cost every start of the study script, its --help included, ~0.5 s of CPU.

# Two-sided tests at this level, intervals at 1 - ALPHA, and the power
# the design is judged by.
ALPHA = 0.05
POWER = 0.8


def paired_t(gains: list[float] | np.ndarray, alpha: float = ALPHA) -> dict[str, float] | None:
    """The paired t statistics of per-seed gains (a head's gain over softmax of the same seed):
    their mean, std (ddof = 1), the two-sided ``1 - alpha`` t interval of the mean and the
    two-sided p-value of a zero mean (a one-sample t test on the gains, which is the paired t
    test of the two heads' perplexities). ``None`` below two gains (no spread to test with).

    Example:
      >>> t = paired_t([1.0, 2.0, 4.0])  # mean 7/3, std sqrt(7/3), t_{0.975, 2} = 4.303
      >>> round(t["ci_low"], 3), round(t["ci_high"], 3), round(t["p"], 4)  # t = 2.646 on 2 df
      (-1.461, 6.128, 0.1181)
    """
    from scipy import stats

    gains = np.asarray(gains, dtype=float)
    n = len(gains)
    if n < 2:
        return None
    mean, std = float(gains.mean()), float(gains.std(ddof=1))
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * std / math.sqrt(n)
    if std > 0:
        p = float(stats.ttest_1samp(gains, 0.0).pvalue)
    else:  # identical gains: certain, whatever their value
        p = 1.0 if mean == 0 else 0.0
    return {"mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half, "p": p}


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (one family, in their order): the ``i``-th
    smallest of ``m`` becomes ``max_{j <= i} min(1, (m - j + 1) p_(j))``; comparing the adjusted
    values with alpha controls the family-wise error rate at alpha.

    Example:
      >>> holm([0.01, 0.04, 0.03])  # 3 x 0.01; max(0.06, 2 x 0.03); max(0.06, 1 x 0.04)
      [0.03, 0.06, 0.06]
    """
    m = len(p_values)
    adjusted, running = [0.0] * m, 0.0
    for position, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - position) * p_values[i]))
        adjusted[i] = round(running, 15)
    return adjusted


def paired_power(effect: float, spread: float, n: int, alpha: float = ALPHA) -> float:
    """The power of the two-sided paired t test at level ``alpha`` with ``n`` pairs against a
    true mean gain ``effect`` when the per-pair gains have std ``spread``: the probability
    that ``|T| > t_{1 - alpha/2, n - 1}`` for T noncentral t with n - 1 degrees of freedom and
    noncentrality ``effect sqrt(n) / spread``.

    Example:
      >>> round(paired_power(0.0, 1.0, 3), 3)  # no effect: the test's own level
      0.05
    """
    from scipy import stats

    if not spread > 0 or n < 2:
        raise ValueError(f"the power needs a spread > 0 and n >= 2 pairs, got {spread}, {n}")
    df, noncentrality = n - 1, effect * math.sqrt(n) / spread
    critical = stats.t.ppf(1 - alpha / 2, df)
    # Each tail as a survival function (the lower one by symmetry): no 1 - (1 - tiny) round-off.
    return float(
        stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality)
    )


def detectable_gain(spread: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean gain that the two-sided paired t test with ``n`` pairs detects
    with probability ``power`` when the per-pair gains have std ``spread`` (in their units).

    Example:
      >>> round(detectable_gain(1.0, 3), 2)  # n = 3: 3.26 times the spread
      3.26
    """
    from scipy import optimize

    return float(
        optimize.brentq(lambda e: paired_power(e, spread, n, alpha) - power, 0.0, 100.0 * spread)
    )


def seeds_needed(
    effect: float, spread: float, alpha: float = ALPHA, power: float = POWER, most: int = 10_000
) -> int:
    """The fewest pairs (seeds, n >= 2) with which the two-sided paired t test detects a true
    mean gain ``effect`` with probability ``power``, per-pair std ``spread``.

    Example:
      >>> seeds_needed(1.0, 0.75)  # Issue #48's estimate: about 7 seeds at a spread of 0.75
      7
    """
    for n in range(2, most + 1):
        if paired_power(effect, spread, n, alpha) >= power:
            return n
    raise ValueError(f"more than {most} seeds needed for effect {effect} at spread {spread}")


def gain_trend(
    ds: list[int], gains: list[float], seeds: list[int], alpha: float = ALPHA
) -> dict[str, Any] | None:
    """A gain's change per doubling of d, with the seeds as the replicates: each seed's
    least-squares slope of its gains on log2 d (seeds with at least two distinct d), then the
    mean of those slopes with its two-sided ``1 - alpha`` t interval and p-value over the seeds
    (:func:`paired_t`: n_seeds - 1 degrees of freedom).

    One point per cell (d, seed), ``ds``, ``gains`` and ``seeds`` aligned. A seed's cells share
    its data order (and initial trunk) at every d, so they are not independent replicates; a
    regression pooled over the cells would count each as one and, where the seeds' own slopes
    differ, give too narrow an interval. On a complete grid the mean of the seeds' slopes is the
    pooled slope; only the interval differs. ``None`` below two seeds with a slope.

    Example:
      >>> ds, seeds = [16, 32] * 3, [1, 1, 2, 2, 3, 3]
      >>> trend = gain_trend(ds, [2.0, 1.0, 1.0, 0.5, 2.0, 0.0], seeds)
      >>> trend["seed_slopes"]  # each seed's gain at d = 32 minus its gain at d = 16
      [-1.0, -0.5, -2.0]
      >>> round(trend["slope"], 3), round(trend["ci_low"], 2), round(trend["ci_high"], 2)
      (-1.167, -3.06, 0.73)
    """
    from scipy import stats

    by_seed: dict[int, list[tuple[float, float]]] = {}
    for d, gain, seed in zip(ds, gains, seeds, strict=True):
        by_seed.setdefault(seed, []).append((math.log2(d), gain))
    slopes = []
    for seed in sorted(by_seed):
        x, y = (np.asarray(v, dtype=float) for v in zip(*by_seed[seed], strict=True))
        if np.ptp(x) > 0:
            slopes.append(float(stats.linregress(x, y).slope))
    t = paired_t(slopes, alpha)
    if t is None:
        return None
    return {
        "slope": t["mean"],
        "ci_low": t["ci_low"],
        "ci_high": t["ci_high"],
        "p": t["p"],
        "seed_slopes": slopes,
        "seeds": len(slopes),
    }
