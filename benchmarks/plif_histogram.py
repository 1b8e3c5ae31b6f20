"""PLIF's backward histogram on this machine: the formulations of its two per-segment sums.

PLIF's slope gradient needs, per segment ``b`` of ``K``, the sums of ``g`` and of ``g * offset``
over the logits in ``b`` (``bottleneck.monotone._plif_bwd``). Timed here at a quarter of the
study's step (``--updates`` logits, segments drawn as a PLIF's logits fall at initialisation: a normal
of std ``--spread`` segments around the middle), interleaved, medians in ms:

* ``two``: two scatter-adds of ``[n]`` into ``[K]`` (the library's, ``segment_histogram`` twice);
* ``pair``: one scatter-add of ``[n, 2]`` rows into ``[K, 2]``;
* ``complex``: one scatter-add of complex64 (the formulation before 69a4b17);
* ``halves``: each sum as two scatters over halves of the logits, added (independent ops that a
  runtime could run on two cores at once);
* ``privatized``: ``segment_histogram``'s accelerator path (``R`` private copies) on this device.

    python benchmarks/plif_histogram.py [--updates 5120000] [--knots 10000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _timing import markdown_table, median_ratio, medians, time_interleaved, write_results

from bottleneck import monotone


def formulations(num_bins: int) -> dict:
    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)

    def two(index, g, offset):
        return zeros(num_bins).at[index].add(g), zeros(num_bins).at[index].add(g * offset)

    def pair(index, g, offset):
        sums = zeros((num_bins, 2)).at[index].add(jnp.stack([g, g * offset], axis=-1))
        return sums[:, 0], sums[:, 1]

    def complex_(index, g, offset):
        sums = jnp.zeros((num_bins,), jnp.complex64).at[index].add(jax.lax.complex(g, g * offset))
        return sums.real, sums.imag

    def halves(index, g, offset):
        h = index.shape[0] // 2

        def summed(values):
            return zeros(num_bins).at[index[:h]].add(values[:h]) + zeros(num_bins).at[
                index[h:]
            ].add(values[h:])

        return summed(g), summed(g * offset)

    def privatized(index, g, offset):
        return (
            monotone._privatized_histogram(index, g, num_bins),
            monotone._privatized_histogram(index, g * offset, num_bins),
        )

    return {
        "two": two,
        "pair": pair,
        "complex": complex_,
        "halves": halves,
        "privatized": privatized,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--updates",
        type=int,
        default=2048 * 10_000 // 4,
        help="logits (default: a quarter of a study step's)",
    )
    parser.add_argument("--knots", type=int, default=10_000)
    parser.add_argument("--spread", type=float, default=60.0, help="std of the segments drawn")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plif_histogram.json"))
    args = parser.parse_args()
    if args.updates < 2 or args.knots < 2 or args.repeats < 1:
        parser.error("--updates and --knots must be >= 2 and --repeats >= 1")
    rng = np.random.default_rng(0)
    middle = args.knots / 2
    index = np.clip(rng.normal(middle, args.spread, args.updates), 0, args.knots - 1)
    index, g = jnp.asarray(index.astype(np.int32)), jnp.asarray(rng.normal(size=args.updates))
    offset = jnp.asarray(rng.random(args.updates))
    g, offset = g.astype(jnp.float32), offset.astype(jnp.float32)
    reference = None
    calls = {}
    for name, fn in formulations(args.knots).items():
        jitted = jax.jit(fn)
        sums = jitted(index, g, offset)
        if reference is None:
            reference = sums
        for got, want in zip(sums, reference, strict=True):  # the same sums, in another order
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
        calls[name] = functools.partial(
            lambda f: jax.block_until_ready(f(index, g, offset)), jitted
        )
    times = time_interleaved(calls, args.repeats)
    ms = medians(times)
    rows = [[name, ms[name], f"{median_ratio(times[name], times['two']):.2f}"] for name in calls]
    table = (
        f"# PLIF's two segment sums: {args.updates:,} logits into {args.knots:,} segments\n\n"
        + markdown_table(["formulation", "ms (median)", "/ two"], rows)
        + f"\n{jax.devices()[0].device_kind}; segments drawn N({middle:g}, {args.spread:g}).\n"
    )
    print(table, end="")
    write_results(
        args.out,
        {"benchmark": "plif_histogram", "args": {**vars(args), "out": str(args.out)},
         "median_ms": ms, "times_ms": times},
        table,
    )  # fmt: skip


if __name__ == "__main__":
    main()
