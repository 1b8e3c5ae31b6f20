"""Ganea et al. 2019, "Synthetic experiments": how well can each output head fit P*(.|c)?

N contexts, M outcomes, true laws P*(.|c_j) ~ Dir(alpha 1_M) sampled once. The model has a free
embedding h_c in R^d per context and a shared output embedding W [M, d] (+ bias) followed by a
head, so only the output layer limits the fit. It is trained full-batch with Adam on the exact
expected cross-entropy -sum_x P*(x|c) log P_theta(x|c). Reported per (head, d, alpha, seed):
mode matching (% of contexts whose most likely outcome is right), cross-entropy, KL to P*, and
the numerical / effective rank of the learned log-probability matrix.

    python experiments/synthetic.py                  # default grid, a few minutes on 2 CPU cores
    python experiments/synthetic.py --preset smoke   # seconds
    python experiments/synthetic.py --preset paper   # larger grid, hours

Writes results.json, results.csv, metrics.jsonl (training curves), config.json and one PNG per
alpha (mode matching and KL against d, one line per head) into --out_dir.
"""

from __future__ import annotations

import experiments  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import sys
import time
from collections import defaultdict
from typing import Annotated

import jax
import matplotlib
import numpy as np
from flax import nnx

from bottleneck import nn
from bottleneck.data.synthetic import dirichlet_targets, expected_cross_entropy, synthetic_metrics
from bottleneck.nn.models import ContextEmbeddingModel
from bottleneck.nn.presets import HeadName
from bottleneck.sharding import (
    mesh_from_flag,
    require_data_divides,
    shard_batch,
    shard_model,
    use_mesh,
)
from bottleneck.train import (
    Trainer,
    UsageError,
    make_optimizer,
    markdown_table,
    open_run,
    parse_config,
    progress,
)
from bottleneck.train.experiment import Checked, Count, Interval, Positive, one_line_errors

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Ganea et al.'s synthetic Dirichlet study (mode matching, cross-entropy, KL, rank)."""

    heads: tuple[HeadName, ...] = (
        "softmax", "sigsoftmax", "sigmoid", "plif", "monotone_mlp", "mos", "moss",
    )  # fmt: skip
    dims: tuple[Count, ...] = (2, 4, 8, 16)
    alphas: tuple[Positive, ...] = (0.01,)
    seeds: tuple[int, ...] = (0,)
    num_contexts: Count = 256
    num_outcomes: Annotated[int, Interval("[2, inf)")] = 512
    steps: Count = 1000
    learning_rate: Positive = 0.01
    num_components: Count = 4
    num_knots: Count = 10_000
    plif_noise: float = 0.0
    num_hidden: Count = 8
    log_every: Count = 100
    mesh: str = ""  # e.g. data=4,vocab=2; empty: all devices on data
    out_dir: str = "runs/synthetic"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.heads or not self.dims or not self.alphas or not self.seeds:
            raise ValueError("heads, dims, alphas and seeds must each name at least one value")
        # Each head's own checks (built abstractly), before a folder is written.
        nn.check_heads(self.heads, **dataclasses.asdict(self))


PRESETS = {
    "smoke": Config(
        heads=("softmax", "plif", "mos"),
        dims=(2, 4),
        num_contexts=32,
        num_outcomes=64,
        steps=40,
        num_knots=100,
        log_every=20,
    ),  # fmt: skip
    "paper": Config(
        dims=(2, 4, 8, 16, 32, 64),
        alphas=(0.01, 0.1, 1.0),
        seeds=(0, 1, 2),
        num_contexts=2048,
        num_outcomes=2048,
        steps=5000,
        num_knots=100_000,
    ),  # fmt: skip
}


def train_one(config: Config, run, head: str, dim: int, alpha: float, seed: int, targets) -> dict:
    """Trains one model full-batch and returns its row of results."""
    mesh = mesh_from_flag(config.mesh)
    with use_mesh(mesh):  # padded, annotated parameters for the mesh
        model = ContextEmbeddingModel(
            config.num_contexts,
            dim,
            config.num_outcomes,
            head,
            rngs=nnx.Rngs(seed),
            **nn.head_options(head, **dataclasses.asdict(config)),
        )
    if mesh is not None:  # contexts split on "data", the head's vocabulary on "vocab"
        model, targets = shard_model(model, mesh), shard_batch(targets, mesh)
    trainer = Trainer(
        model,
        make_optimizer(config.learning_rate),
        lambda model, targets: expected_cross_entropy(targets, model()),
    )
    start = time.perf_counter()
    for step in range(0, config.steps, config.log_every):
        losses = trainer.run(targets, min(config.log_every, config.steps - step))
        run.log_metrics(
            {
                "head": head,
                "d": dim,
                "alpha": alpha,
                "seed": seed,
                "step": step + len(losses),
                "loss": float(losses[-1]),
            }
        )
    metrics = synthetic_metrics(targets, jax.jit(lambda m: m())(trainer.model))
    return {
        "head": head,
        "d": dim,
        "alpha": alpha,
        "seed": seed,
        **{name: float(value) for name, value in metrics._asdict().items()},
        "seconds": time.perf_counter() - start,
    }


TABLE_COLUMNS = (
    "alpha", "d", "head", "mode_matching", "cross_entropy", "kl", "numerical_rank", "effective_rank",
)  # fmt: skip
PAGE_TEXT = (
    "Mean over seeds per alpha, d and head: mode matching in % of contexts, cross-entropy and "
    "KL(P* || P_theta) in nats, numerical and effective (99% energy) rank of the learned "
    "contexts x outcomes log-probability matrix.\n\n"
)


def summarize(rows: list[dict]) -> list[dict]:
    """Mean over seeds per (alpha, d, head)."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row["alpha"], row["d"], row["head"])].append(row)
    summary = []
    for (alpha, dim, head), group in sorted(groups.items()):
        mean = {
            k: float(np.mean([r[k] for r in group]))
            for k in (
                "mode_matching",
                "cross_entropy",
                "kl",
                "numerical_rank",
                "effective_rank",
                "near_tied_modes",
            )
        }
        summary.append({"alpha": alpha, "d": dim, "head": head, "seeds": len(group), **mean})
    return summary


def plot(summary: list[dict], run, heads: tuple[str, ...]) -> list:
    """One PNG per alpha: mode matching and KL against d, one line per head (the slides' figure)."""
    paths = []
    for alpha in sorted({row["alpha"] for row in summary}):
        fig, (ax_mode, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.2))
        for head in heads:
            rows = sorted(
                (r for r in summary if r["alpha"] == alpha and r["head"] == head),
                key=lambda r: r["d"],
            )
            dims = [r["d"] for r in rows]
            ax_mode.plot(dims, [r["mode_matching"] for r in rows], marker="o", label=head)
            ax_kl.plot(dims, [r["kl"] for r in rows], marker="o", label=head)
        for ax, ylabel in ((ax_mode, "mode matching (%)"), (ax_kl, "KL(P* || P_theta) (nats)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("embedding size d")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        ax_mode.legend(fontsize=8)
        fig.suptitle(f"Synthetic Dirichlet task, alpha = {alpha}")
        fig.tight_layout()
        path = run.path(f"synthetic_alpha{alpha:g}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> list[dict]:
    config = parse_config(Config, PRESETS, argv)
    with one_line_errors(config):  # this process's devices: checked before the folder is made
        try:
            require_data_divides(config.mesh, "num_contexts", config.num_contexts)
        except ValueError as err:
            raise UsageError(str(err)) from None
    run = open_run(config.out_dir, config)
    grid = [
        (a, s, d, h)
        for a in config.alphas
        for s in config.seeds
        for d in config.dims
        for h in config.heads
    ]
    rows: list[dict] = []
    bar = progress(grid, desc="synthetic")
    for alpha, seed, dim, head in bar:
        bar.set_postfix(head=head, d=dim, alpha=alpha, seed=seed)
        # The task depends on (alpha, seed) only, so every head and d fits the same P*.
        targets = dirichlet_targets(
            jax.random.key(seed), config.num_contexts, config.num_outcomes, alpha
        )
        rows.append(train_one(config, run, head, dim, alpha, seed, targets))
        # Rewritten after every run, so an interrupted grid keeps what it finished.
        run.write_json("results.json", {"runs": rows})
        run.write_csv("results.csv", rows)
    summary = summarize(rows)
    run.write_json("results.json", {"runs": rows, "summary": summary})
    table = markdown_table(summary, TABLE_COLUMNS, floatfmt=".4g")
    print(table)
    run.write_page("results.md", "Synthetic Dirichlet study (Ganea et al. 2019)", PAGE_TEXT + table)
    paths = plot(summary, run, config.heads)
    print(
        f"\nwrote {run.root}/results.json, results.md, results.csv, metrics.jsonl, "
        + ", ".join(p.name for p in paths)
    )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
