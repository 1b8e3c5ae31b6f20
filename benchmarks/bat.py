"""Seconds per drawn token of basis-aware truncation, with and without the primal certificate.

``bn.generate(..., bat_tau=TAU)`` decides each drawn token below ``TAU`` (the rest are kept at
once) by a dual certificate (keeps), a primal certificate (discards: the least-squares move of
the token's mass, ``bottleneck.truncation.BatProblem``) and only then a linear program. This
times those decisions on softmax distributions ``softmax(W h)`` with a random decoder ``W [M, d]``
(``N(0, 1/d)`` rows) and hidden state (logits of standard deviation ``--logit_std``), tokens
drawn from the distribution itself until ``--draws`` of them fall below ``TAU``, at M = 2,000 and
10,000 words and d = 64 and 128. "Before" is the same decision without the primal certificate
(the dual certificate, else a program): the code as the issue found it. Synthetic distributions,
not a trained model's: a trained decoder's geometry may make either certificate fire more or
less often; the programs' own seconds do not depend on it much.

    python benchmarks/bat.py [--draws 6] [--tau 0.01] [--out benchmarks/results/bat.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from _timing import markdown_table, write_results

from bottleneck import truncation


class WithoutPrimal(truncation.BatProblem):
    """The decisions as before the primal certificate: the dual one, else a program."""

    def _moved_mass_fits(self, i: int) -> bool:
        return False


def decide(problem: truncation.BatProblem, token: int) -> tuple[bool, str, float]:
    """The decision, the step that made it, and its seconds."""
    start = time.perf_counter()
    programs = problem.programs
    keep = problem.keep(token)
    seconds = time.perf_counter() - start
    if problem.programs > programs:
        how = "program"
    elif keep:
        how = "dual certificate"
    else:
        how = "primal certificate"
    return keep, how, seconds


def measure(M: int, d: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng([M, d])
    W = rng.normal(size=(M, d)) / np.sqrt(d)
    logits = W @ rng.normal(size=d)
    logits *= args.logit_std / logits.std()
    log_p = logits - np.logaddexp.reduce(logits)
    p = np.exp(log_p)
    below = p < args.tau
    tokens = [int(t) for t in rng.choice(M, size=20 * args.draws, p=p) if below[t]][: args.draws]
    rows = []
    for token in tokens:
        after = decide(truncation.BatProblem(log_p, W, args.tau), token)
        before = decide(WithoutPrimal(log_p, W, args.tau), token)
        assert after[0] == before[0], "the certificate changed a decision"
        rows.append({"token": token, "keep": after[0], "after": after[1:], "before": before[1:]})
    after_s = [r["after"][1] for r in rows]
    before_s = [r["before"][1] for r in rows]
    return {
        "M": M,
        "d": d,
        "mass_below_tau": float(p[below].sum()),
        "drawn_below_tau": len(rows),
        "kept": sum(r["keep"] for r in rows),
        "after_median_s": float(np.median(after_s)),
        "after_mean_s": float(np.mean(after_s)),
        "before_median_s": float(np.median(before_s)),
        "before_mean_s": float(np.mean(before_s)),
        "after_by": {
            h: sum(r["after"][0] == h for r in rows) for h in {r["after"][0] for r in rows}
        },
        "tokens": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=6, help="drawn tokens below tau per case")
    parser.add_argument("--tau", type=float, default=0.01)
    parser.add_argument("--logit_std", type=float, default=2.5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bat.json"))
    args = parser.parse_args()
    if args.draws < 1 or not 0 < args.tau < 1:
        parser.error("--draws must be >= 1 and --tau in (0, 1)")
    cases = [measure(M, d, args) for M in (2_000, 10_000) for d in (64, 128)]
    header = ["M", "d", "drawn below tau", "kept", "decided after by", "s/token before (median, mean)",
              "s/token after (median, mean)"]  # fmt: skip
    rows = [
        [c["M"], c["d"], c["drawn_below_tau"], c["kept"],
         ", ".join(f"{h} {n}" for h, n in sorted(c["after_by"].items())),
         f"{c['before_median_s']:.3f}, {c['before_mean_s']:.3f}",
         f"{c['after_median_s']:.3f}, {c['after_mean_s']:.3f}"]
        for c in cases
    ]  # fmt: skip
    table = "# Basis-aware truncation: seconds per drawn token below tau\n\n" + markdown_table(
        header, rows
    )
    table += (
        f"\ntau {args.tau}, logits of std {args.logit_std}, {args.draws} drawn tokens below tau "
        "per case; tokens above tau are kept at once (no time).\n"
    )
    print(table, end="")
    write_results(args.out, {"benchmark": "bat", "args": vars(args) | {"out": str(args.out)},
                             "cases": cases}, table)  # fmt: skip


if __name__ == "__main__":
    main()
