"""Each head's chunked loss against its chunks' memory budget, at the converged study's shape.

``head.loss`` walks the tokens in chunks of at most ``memory_budget`` bytes. The budget sets the
speed as well as the memory: a chunk whose arrays stay in the CPU's caches costs less per token
than one that streams through main memory, and the best budget depends on the head (a Mixtape
chunk keeps ``K`` component logits and ``K - 1`` gate pre-activations per word) and on the
machine. This times the jit-compiled forward+backward pass of ``head.loss(h, labels)`` (gradients
of every parameter and of ``h``) for each head and budget, interleaved in one process
(``benchmarks/_timing.py``), at one batch of ``experiments/lm_study.py``'s grid: 32 x 64 =
2,048 tokens, the head's input width ``d`` (default 32), PTB's 10,000 words, the study's head
options (K = 4 with linear latents, PLIF with 10,000 knots). The table gives median
milliseconds and each head's time relative to its time at the library's default budget.

Run from the repository root (about a minute on 2 cores, alone on the machine):

    python benchmarks/chunk_budget.py [--d 32] [--budgets-mib 8,16,32] [--repeats 7]
        [--out benchmarks/results/chunk_budget.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from _timing import machine_info, markdown_table, medians, time_interleaved, write_results
from flax import nnx
from tqdm import tqdm

from bottleneck import nn
from bottleneck.losses import DEFAULT_MEMORY_BUDGET
from bottleneck.runs import lm_study

# The study's trunk: its batch and its head options, read from the study itself.
STUDY = lm_study.Config().trunk
TOKENS, VOCAB = STUDY.data.batch_size * STUDY.data.bptt, 10_000  # PTB's vocabulary
MIB = 2**20


def loss_and_grads(name: str, d: int, budget_mib: int, h: jax.Array, labels: jax.Array):
    """A zero-argument call of the head's jitted loss and gradients at this budget."""
    options = dataclasses.replace(STUDY.head, name=name).options()
    options["memory_budget"] = budget_mib * MIB
    head = nn.make_head(name, d, VOCAB, rngs=nnx.Rngs(0), **options)

    @nnx.jit
    def step(head: nn.OutputHead, h: jax.Array, labels: jax.Array):
        return nnx.value_and_grad(lambda m, h: m.loss(h, labels), argnums=(0, 1))(head, h)

    return lambda: step(head, h, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="softmax,sigsoftmax,plif,mos,mixtape")
    parser.add_argument("--d", type=int, default=32, help="the head's input width")
    parser.add_argument("--budgets-mib", default="8,16,32", help="comma-separated MiB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chunk_budget.json"))
    args = parser.parse_args()
    heads = args.heads.split(",")
    budgets = sorted({int(b) for b in args.budgets_mib.split(",")} | {DEFAULT_MEMORY_BUDGET // MIB})
    for name in heads:
        if name not in nn.HEAD_NAMES:
            parser.error(f"unknown head {name!r}; choose from {', '.join(nn.HEAD_NAMES)}")
    h_key, labels_key = jax.random.split(jax.random.key(0))
    h = jax.random.normal(h_key, (TOKENS, args.d), jnp.float32)
    labels = jax.random.randint(labels_key, (TOKENS,), 0, VOCAB)
    calls = {
        f"{name}@{mib}": loss_and_grads(name, args.d, mib, h, labels)
        for name in heads
        for mib in budgets
    }
    with tqdm(total=len(calls) * (args.repeats + 1), desc="chunk budget") as progress:
        times = time_interleaved(calls, args.repeats, on_call=progress.update)
    ms = medians(times)
    default = DEFAULT_MEMORY_BUDGET // MIB
    rows = [
        [name, *(f"{ms[f'{name}@{mib}']:.0f} ({ms[f'{name}@{mib}'] / ms[f'{name}@{default}']:.2f})"
                 for mib in budgets)]
        for name in heads
    ]  # fmt: skip
    header = ["head", *(f"{mib} MiB" + (" (default)" if mib == default else "") for mib in budgets)]
    markdown = (
        f"# Chunked loss against the chunk budget (d = {args.d}, {TOKENS} tokens, "
        f"{VOCAB} words)\n\nMedian ms of the loss's forward+backward over {args.repeats} "
        f"interleaved repetitions (in brackets: relative to the default budget).\n\n"
        + markdown_table(header, rows)
    )
    write_results(
        args.out,
        {"d": args.d, "tokens": TOKENS, "vocab": VOCAB, "budgets_mib": budgets,
         "median_ms": ms, "times_ms": times, "machine": machine_info()},
        markdown,
    )  # fmt: skip
    print(markdown)


if __name__ == "__main__":
    main()
