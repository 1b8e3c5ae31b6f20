"""How much memory each head's chunked loss needs: the chunks' work, bounded by the budget, and
what is the size of the head's parameters.

Compiles the forward + backward pass of ``head.loss(h, labels)`` (gradients for every parameter
of the head and for ``h``, as ``benchmarks/head_cost.py`` times it) and reads the compiler's
temporary buffers (``compiled.memory_analysis().temp_size_in_bytes``): no array is computed,
so the numbers are the same on any machine with the same XLA backend, loaded or not. Each head
at the study's width (d = 32) and Merity et al.'s (d = 400), 10,000 words, at three token counts
and two chunk budgets (``memory_budget``, the default 32 MiB and 8 MiB).

What it separates: the chunks' work (the logits of one chunk and what its backward needs),
which the budget bounds whatever the tokens, and what lies beyond the budget, which does not
grow with the tokens either: the head's parameter gradients, accumulated across chunks. The
head-cost issue's memory target, "under a quarter of the full logits' bytes", is read against
both.

Run from the repository root (a minute or two on 2 cores; compiling only):

    python benchmarks/loss_memory.py [--data_dir PTB_DIR] [--out benchmarks/results/loss_memory.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np
from _shapes import HEADS, cost_head, loss_and_gradients, token_counts
from _timing import machine_info, markdown_table, write_results
from flax import nnx
from tqdm import tqdm

VOCAB = 10_000
DIMS = (32, 400)
TOKENS = (700, 1400, 2800)
BUDGETS_MIB = (32, 8)
SHARED_GATE_BELOW = 100
QUARTER = 0.25  # the head-cost issue's target, as a fraction of the full float32 logits


def temporary_bytes(head: nnx.Module, tokens: int, dim: int) -> int:
    """The compiled loss-and-gradients pass's temporary bytes at ``tokens`` hidden states."""
    fn, state = loss_and_gradients(head)
    compiled = fn.lower(
        state,
        jax.ShapeDtypeStruct((tokens, dim), np.float32),
        jax.ShapeDtypeStruct((tokens,), np.int32),
    ).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(counts: np.ndarray) -> list[dict]:
    rows = []
    cases = [(h, d, b) for h in HEADS for d in DIMS for b in BUDGETS_MIB]
    for head_name, dim, budget in tqdm(cases, desc="heads", unit="case"):
        head = cost_head(
            head_name, dim, VOCAB, counts, SHARED_GATE_BELOW, memory_budget=budget * 2**20
        )
        params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(head, nnx.Param)))
        temps = {tokens: temporary_bytes(head, tokens, dim) for tokens in TOKENS}
        budget_bytes = budget * 2**20
        for tokens in TOKENS:
            rows.append({
                "head": head_name, "d": dim, "budget_mib": budget, "tokens": tokens,
                "temp_mb": temps[tokens] / 1e6, "params_mb": params / 1e6,
                "temp_over_logits": temps[tokens] / (tokens * VOCAB * 4),
                "temp_over_budget": temps[tokens] / budget_bytes,
                "beyond_budget_over_params": max(temps[tokens] - budget_bytes, 0) / params,
                "growth_mb": (temps[tokens] - temps[TOKENS[0]]) / 1e6,
            })  # fmt: skip
    return rows


def page(rows: list[dict], counts_source: str) -> str:
    lines = [
        "# Memory of each head's chunked loss: the chunks' work and the parameters' gradients",
        "",
        f"Forward + backward of `head.loss` (all gradients), {VOCAB:,} words; the compiler's "
        "temporary bytes (`memory_analysis`, nothing computed), over the full float32 logits "
        "and over the chunk budget; 'beyond the budget' in units of the head's parameter bytes "
        f"(their gradients, accumulated across chunks); 'growth' since {TOKENS[0]:,} tokens. "
        f"Mixtape shared: words seen < {SHARED_GATE_BELOW} times share one gate (counts: "
        f"{counts_source}). Target of the head-cost issue: temporaries under {QUARTER:g} of the "
        "full logits.",
        "",
    ]
    header = [
        "head", "d", "budget MiB", "tokens", "temp MB", "/ logits", "/ budget", "params MB",
        "beyond budget / params", "growth MB",
    ]  # fmt: skip
    table = [
        [
            r["head"], r["d"], r["budget_mib"], r["tokens"], r["temp_mb"],
            f"{r['temp_over_logits']:.3f}", f"{r['temp_over_budget']:.2f}", r["params_mb"],
            f"{r['beyond_budget_over_params']:.2f}", r["growth_mb"],
        ]
        for r in rows
    ]  # fmt: skip
    lines.append(markdown_table(header, table))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", type=Path, help="PTB's folder, for Mixtape's word counts")
    parser.add_argument("--out", default="benchmarks/results/loss_memory.json")
    args = parser.parse_args()
    counts, source = token_counts(args.data_dir, VOCAB)
    rows = measure(counts)
    markdown = page(rows, source)
    write_results(args.out, {"machine": machine_info(), "rows": rows}, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
