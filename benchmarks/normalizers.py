"""Speed of the library's normalizers and PLIF against naive jax.nn / autodiff versions.

For logits of shape [1400, 10000] float32 (on JAX's default backend) it times the jit-compiled
forward pass (mean cross-entropy of random labels) and forward+backward pass
(``jax.value_and_grad`` of that loss) of

* ``bn.log_softmax``, ``bn.log_sigsoftmax``, ``bn.log_sigmoid_normalizer`` and
  ``bn.log_relu_normalizer``, each against the same maths written with ``jax.nn``;
* ``bn.plif`` followed by ``jax.nn.log_softmax``, with 1e5 and 1e6 knots (gradient w.r.t. the
  logits and the raw slopes), against a naive PLIF: two gathers, JAX autodiff for the backward.

Library and naive versions run interleaved in one process (``benchmarks/_timing.py``). The
table gives median milliseconds and the median of per-repetition ratios library / naive
(below 1: the library is faster). The JSON also records the largest relative difference
between the two versions' loss and gradients, as a check that they compute the same thing.

Run from the repository root:

    python benchmarks/normalizers.py [--quick] [--out benchmarks/results/normalizers.json]

``--quick`` times 5 repetitions instead of 15. The markdown table is printed and also saved next
to the JSON file, with the suffix ``.md``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _timing import (
    machine_info,
    markdown_table,
    median_ratio,
    medians,
    time_interleaved,
    write_results,
)
from tqdm import tqdm

import bottleneck as bn

SHAPE = (1400, 10000)
LOGIT_SCALE = 5.0  # logits ~ N(0, 5^2): they cover much of the PLIF knot range [-20, 20]
PLIF_BOUND = 20.0
RELU_EPS = 1e-8

LogProbs = Callable[..., jax.Array]  # (logits, *parameters) -> [..., vocab] log-probabilities


@dataclass(frozen=True)
class Case:
    """One library function and its naive counterpart, both mapping ``inputs`` to log-probs."""

    name: str
    library: LogProbs
    naive: LogProbs
    inputs: tuple[jax.Array, ...]  # the loss is differentiated with respect to all of them


def naive_plif(z: jax.Array, raw_slopes: jax.Array, bound: float = PLIF_BOUND) -> jax.Array:
    """PLIF written for plain autodiff: gathers from separate intercept and slope tables."""
    num_knots = raw_slopes.shape[0]
    delta = 2.0 * bound / num_knots
    slopes = jax.nn.softplus(raw_slopes)
    intercepts = -bound + delta * (jnp.cumsum(slopes) - slopes)
    index = jnp.clip(jnp.floor((z + bound) / delta), 0, num_knots - 1).astype(jnp.int32)
    return intercepts[index] + slopes[index] * (z - (-bound + index * delta))


def naive_sigmoid_normalizer(z: jax.Array) -> jax.Array:
    sigmoid = jax.nn.sigmoid(z)
    return jnp.log(sigmoid / jnp.sum(sigmoid, axis=-1, keepdims=True))


def naive_relu_normalizer(z: jax.Array) -> jax.Array:
    scores = jax.nn.relu(z) + RELU_EPS
    return jnp.log(scores / jnp.sum(scores, axis=-1, keepdims=True))


def make_cases(key: jax.Array) -> list[Case]:
    logits_key, slopes_key = jax.random.split(key)
    z = LOGIT_SCALE * jax.random.normal(logits_key, SHAPE, jnp.float32)
    cases = [
        Case("log_softmax", bn.log_softmax, jax.nn.log_softmax, (z,)),
        Case(
            "log_sigsoftmax",
            bn.log_sigsoftmax,
            lambda z: jax.nn.log_softmax(2 * z - jax.nn.softplus(z)),
            (z,),
        ),
        Case("log_sigmoid_normalizer", bn.log_sigmoid_normalizer, naive_sigmoid_normalizer, (z,)),
        Case("log_relu_normalizer", bn.log_relu_normalizer, naive_relu_normalizer, (z,)),
    ]
    for knots_label, num_knots in (("1e5", 10**5), ("1e6", 10**6)):
        raw_slopes = bn.plif_init(slopes_key, num_knots, noise=1.0)
        cases.append(
            Case(
                f"plif K={knots_label} + log_softmax",
                lambda z, raw: jax.nn.log_softmax(bn.plif(z, raw, PLIF_BOUND)),
                lambda z, raw: jax.nn.log_softmax(naive_plif(z, raw)),
                (z, raw_slopes),
            )
        )
    return cases


def timed_calls(case: Case, labels: jax.Array) -> dict[str, Callable[[], Any]]:
    """Zero-argument calls ``{fwd,fwd+bwd}/{library,naive}`` with the inputs bound."""
    calls: dict[str, Callable[[], Any]] = {}
    for implementation, log_probs in (("library", case.library), ("naive", case.naive)):

        def loss(
            inputs: tuple[jax.Array, ...], labels: jax.Array, log_probs: LogProbs = log_probs
        ) -> jax.Array:
            return bn.cross_entropy(log_probs(*inputs), labels)

        calls[f"fwd/{implementation}"] = functools.partial(jax.jit(loss), case.inputs, labels)
        calls[f"fwd+bwd/{implementation}"] = functools.partial(
            jax.jit(jax.value_and_grad(loss)), case.inputs, labels
        )
    return calls


def max_relative_difference(calls: dict[str, Callable[[], Any]]) -> float:
    """Largest ``max|library - naive| / max|naive|`` over the loss and each gradient."""
    library, naive = calls["fwd+bwd/library"](), calls["fwd+bwd/naive"]()
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(library), jax.tree.leaves(naive), strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repetitions instead of 15")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/normalizers.json"))
    args = parser.parse_args()
    repeats = 5 if args.quick else 15

    labels_key, cases_key = jax.random.split(jax.random.key(0))
    labels = jax.random.randint(labels_key, SHAPE[:1], 0, SHAPE[1])
    cases = make_cases(cases_key)

    results: dict[str, dict[str, Any]] = {}
    progress = tqdm(total=len(cases) * 4 * (repeats + 1), desc="timing", unit="call")
    for case in cases:
        progress.set_postfix_str(case.name)
        calls = timed_calls(case, labels)
        times = time_interleaved(calls, repeats, on_call=progress.update)
        median_ms = medians(times)
        results[case.name] = {
            pass_name: {
                "library_ms": median_ms[f"{pass_name}/library"],
                "naive_ms": median_ms[f"{pass_name}/naive"],
                "ratio": median_ratio(times[f"{pass_name}/library"], times[f"{pass_name}/naive"]),
            }
            for pass_name in ("fwd", "fwd+bwd")
        }
        results[case.name]["max_relative_difference"] = max_relative_difference(calls)
    progress.close()

    header = [
        "function",
        "fwd ms (lib)",
        "fwd ms (naive)",
        "fwd+bwd ms (lib)",
        "fwd+bwd ms (naive)",
        "fwd+bwd ratio",
    ]
    rows = [
        [
            name,
            result["fwd"]["library_ms"],
            result["fwd"]["naive_ms"],
            result["fwd+bwd"]["library_ms"],
            result["fwd+bwd"]["naive_ms"],
            f"{result['fwd+bwd']['ratio']:.2f}",
        ]
        for name, result in results.items()
    ]
    table = markdown_table(header, rows)
    print(table, end="")
    write_results(
        args.out,
        {
            "benchmark": "normalizers",
            "machine": machine_info(),
            "shape": list(SHAPE),
            "dtype": "float32",
            "logit_scale": LOGIT_SCALE,
            "plif_bound": PLIF_BOUND,
            "repeats": repeats,
            "loss": "mean cross-entropy of uniform random labels; fwd+bwd = jax.value_and_grad",
            "ratio": "median over repetitions of library_ms / naive_ms",
            "results": results,
        },
        table,
    )


if __name__ == "__main__":
    main()
