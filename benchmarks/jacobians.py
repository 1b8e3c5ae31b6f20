"""Speed of the forward-mode Jacobians behind the gradient-bottleneck diagnostic, per position.

``bn.head_gradient_ratio`` projects the loss gradient on the columns of each position's Jacobian
``[M, d]``; for a mixture head it builds that Jacobian with ``jax.vmap(jax.jacfwd(...))``, ``d``
forward-mode products per position (``experiments/consequences.py`` does this at 2,048 test
positions per trained model). Two parts, each interleaved in one process
(``benchmarks/_timing.py``):

* **Mixtape's gating in both modes.** ``bn.mixtures.sigmoid_tree_gated_logits`` (the fused
  tree, one sigmoid per gate) against its naive composition, ``gated_logits`` of
  ``sigmoid_tree_log_weights`` by plain autodiff, with the component logits and gate
  pre-activations linear in ``h`` as in the head (``K = 4``, ``M = 10,000``): the Jacobian of
  the gated logits at ``--positions`` hidden states (forward mode, what the diagnostic does),
  and the mean cross-entropy's ``value_and_grad`` over ``--tokens`` positions (reverse mode,
  what training does).
* **The diagnostic per head.** ``bn.head_gradient_ratio`` on ``--positions`` random hidden
  states of a freshly initialised head of every name in ``--heads`` (``K = 4`` for the
  mixtures), against softmax's (its Jacobian is its decoder: one SVD per position).

The tables give median milliseconds per position (per call for reverse mode) and the median
of per-repetition ratios; the JSON also records the largest difference between the fused and
composed Jacobians and gradients.

Run from the repository root (about 5 minutes on 2 cores):

    python benchmarks/jacobians.py [--d 128] [--positions 16] [--tokens 1024] [--repeats 5]
        [--heads softmax,sigsoftmax,plif,mos,mixtape] [--out benchmarks/results/jacobians.json]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
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
from flax import nnx
from tqdm import tqdm

import bottleneck as bn
from bottleneck import nn

VOCAB = 10_000
COMPONENTS = 4
HEADS = ("softmax", "sigsoftmax", "plif", "mos", "mixtape")  # the converged study's


def fused(component_logits: jax.Array, pre_activations: jax.Array) -> jax.Array:
    return bn.mixtures.sigmoid_tree_gated_logits(component_logits, pre_activations)


def composed(component_logits: jax.Array, pre_activations: jax.Array) -> jax.Array:
    log_weights = bn.mixtures.sigmoid_tree_log_weights(pre_activations, axis=-2)
    return bn.mixtures.gated_logits(component_logits, log_weights)


def gating_calls(d: int, positions: int, tokens: int) -> dict[str, Callable[[], Any]]:
    """``{jacobian,loss}/{fused,composed}``: zero-argument calls with their inputs bound."""
    keys = jax.random.split(jax.random.key(0), 5)
    scale = d**-0.5  # unit-variance logits and pre-activations for unit-variance h
    components = scale * jax.random.normal(keys[0], (COMPONENTS, VOCAB, d))
    gates = scale * jax.random.normal(keys[1], (COMPONENTS - 1, VOCAB, d))
    h = jax.random.normal(keys[2], (positions, d))
    z = jax.random.normal(keys[3], (tokens, COMPONENTS, VOCAB))
    pre = jax.random.normal(keys[4], (tokens, COMPONENTS - 1, VOCAB))
    labels = jax.random.randint(keys[4], (tokens,), 0, VOCAB)
    calls = {}
    for name, gate in (("fused", fused), ("composed", composed)):

        def logits(x: jax.Array, gate: Callable = gate) -> jax.Array:
            return gate(components @ x, gates @ x)

        def loss(z: jax.Array, pre: jax.Array, gate: Callable = gate) -> jax.Array:
            return bn.cross_entropy(jax.nn.log_softmax(gate(z, pre), axis=-1), labels)

        jacobians = jax.jit(jax.vmap(jax.jacfwd(logits)))
        value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        calls[f"jacobian/{name}"] = lambda f=jacobians: f(h)
        calls[f"loss/{name}"] = lambda f=value_and_grad: f(z, pre)
    return calls


def ratio_calls(heads: list[str], d: int, positions: int) -> dict[str, Callable[[], Any]]:
    """``ratio/{head}``: ``bn.head_gradient_ratio`` of a fresh head at ``positions`` states."""
    h = jax.random.normal(jax.random.key(1), (positions, d))
    labels = jax.random.randint(jax.random.key(2), (positions,), 0, VOCAB)
    calls = {}
    for name in heads:
        options = {"num_components": COMPONENTS} if name in ("mos", "mixtape") else {}
        head = nn.make_head(name, d, VOCAB, rngs=nnx.Rngs(0), **options)
        ratios = nnx.jit(bn.head_gradient_ratio)
        calls[f"ratio/{name}"] = lambda f=ratios, head=head: f(head, h, labels)
    return calls


def max_difference(calls: dict[str, Callable[[], Any]], part: str) -> float:
    """Largest ``max|fused - composed| / max|composed|`` over a part's outputs."""
    got, want = calls[f"{part}/fused"](), calls[f"{part}/composed"]()
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--positions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", default=",".join(HEADS), help="comma-separated")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/jacobians.json"))
    args = parser.parse_args()
    heads = [name.strip() for name in args.heads.split(",") if name.strip()]
    if "softmax" not in heads:
        parser.error("--heads must include softmax, the reference of the ratios")
    for name in heads:
        if name not in nn.HEAD_NAMES:
            parser.error(f"unknown head {name!r}; choose from {', '.join(nn.HEAD_NAMES)}")
    if min(args.d, args.positions, args.tokens, args.repeats) < 1:
        parser.error("--d, --positions, --tokens and --repeats must be >= 1")

    calls = gating_calls(args.d, args.positions, args.tokens)
    differences = {part: max_difference(calls, part) for part in ("jacobian", "loss")}
    calls |= ratio_calls(heads, args.d, args.positions)
    with tqdm(total=len(calls) * (args.repeats + 1), desc="jacobians") as progress:
        times = time_interleaved(calls, args.repeats, on_call=progress.update)
    ms = medians(times)
    per_position = {
        name: value / args.positions for name, value in ms.items() if not name.startswith("loss")
    }
    gating_rows = [
        [
            part,
            f"{(per_position if part == 'jacobian' else ms)[f'{part}/fused']:.1f}",
            f"{(per_position if part == 'jacobian' else ms)[f'{part}/composed']:.1f}",
            f"{median_ratio(times[f'{part}/fused'], times[f'{part}/composed']):.3f}",
            f"{differences[part]:.1e}",
        ]
        for part in ("jacobian", "loss")
    ]
    ratio_rows = [
        [
            name,
            f"{per_position[f'ratio/{name}']:.1f}",
            f"{median_ratio(times[f'ratio/{name}'], times['ratio/softmax']):.2f}",
        ]
        for name in heads
    ]
    markdown = (
        f"# Forward-mode Jacobians: Mixtape's gating and the gradient-bottleneck diagnostic "
        f"(d = {args.d}, {VOCAB} words)\n\n"
        f"Median over {args.repeats} interleaved repetitions. Mixtape's gating (K = "
        f"{COMPONENTS}): the Jacobian of the gated logits by `jax.vmap(jax.jacfwd)` in ms per "
        f"position ({args.positions} positions a call), and the cross-entropy's "
        f"`value_and_grad` over {args.tokens} positions in ms a call; fused / composed: the "
        "median ratio; difference: the largest |fused - composed| / max |composed|.\n\n"
        + markdown_table(
            ["mode", "fused (ms)", "composed (ms)", "fused / composed", "difference"], gating_rows
        )
        + f"\n`bn.head_gradient_ratio` of a freshly initialised head, ms per position ("
        f"{args.positions} a call), and its median ratio to softmax's:\n\n"
        + markdown_table(["head", "ms / position", "x softmax"], ratio_rows)
    )
    write_results(
        args.out,
        {
            "benchmark": "jacobians",
            "d": args.d,
            "vocab": VOCAB,
            "components": COMPONENTS,
            "positions": args.positions,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "heads": heads,
            "median_ms": ms,
            "ms_per_position": per_position,
            "max_relative_difference": differences,
            "times_ms": times,
            "machine": machine_info(),
        },
        markdown,
    )
    print(markdown)


if __name__ == "__main__":
    main()
