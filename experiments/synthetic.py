"""Ganea et al. 2019, "Synthetic experiments": how well can each output head fit P*(.|c)?

N contexts, M outcomes, true laws P*(.|c_j) ~ Dir(alpha 1_M) sampled once. The model has a free
embedding h_c in R^d per context and a shared output embedding W [M, d] (+ bias) followed by a
head, so only the output layer limits the fit. It is trained full-batch with Adam on the exact
expected cross-entropy -sum_x P*(x|c) log P_theta(x|c). Reported per (head, d, alpha, seed):
mode matching (% of contexts whose most likely outcome is right), cross-entropy, KL to P*, and
the numerical / effective rank of the learned log-probability matrix; then their mean +- std
over the seeds (``--seeds``, three by default: each seed draws its own P* and initialisation).

    python experiments/synthetic.py                  # default grid: ~4 minutes on 2 CPU cores
    python experiments/synthetic.py smoke   # seconds
    python experiments/synthetic.py paper   # larger grid, hours

Resumable: rerunning the command in the same --out_dir keeps the runs it finished and trains the
others (the grid's flags --heads, --dims, --alphas, --seeds may change; every other setting must
match, else one line says which differs). Ctrl-C stops between two logging intervals, keeps the
finished runs and writes the page and plots of what is done (titled partial).

Writes results.json (``runs``: one row per seed; ``summary``: mean and std over seeds),
results.csv (the per-seed rows), results.md (mean +- std, then every seed's row), metrics.jsonl
(training curves), config.json and one PNG per alpha (mode matching and KL against d, one line
per head, error bars the std over seeds) into --out_dir.
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Annotated

import jax
import numpy as np
from flax import nnx

from bottleneck import nn
from bottleneck.data.synthetic import dirichlet_targets, expected_cross_entropy, synthetic_metrics
from bottleneck.nn.models import ContextEmbeddingModel
from bottleneck.nn.presets import HeadName
from bottleneck.runs import UsageError, markdown_table, open_run, parse_config, progress, pyplot
from bottleneck.runs.cli import Checked, Count, Interval, Positive, one_line_errors
from bottleneck.runs.folder import StopSignals, TrainingInterrupted, check_resumable
from bottleneck.sharding import (
    mesh_from_flag,
    require_data_divides,
    shard_batch,
    shard_model,
    use_mesh,
)
from bottleneck.train import Trainer, make_optimizer


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Ganea et al.'s synthetic Dirichlet study (mode matching, cross-entropy, KL, rank)."""

    #: the output heads compared (bottleneck.nn.HEAD_NAMES), each at every d, alpha and seed
    heads: tuple[HeadName, ...] = (
        "softmax", "sigsoftmax", "sigmoid", "plif", "monotone_mlp", "mos", "moss",
    )  # fmt: skip
    dims: tuple[Count, ...] = (2, 4, 8, 16)  # embedding sizes d (the bottleneck's width)
    #: Dirichlet concentrations of the true laws P*(.|c) ~ Dir(alpha 1): small is peaked
    alphas: tuple[Positive, ...] = (0.01,)
    #: each seed draws its own true laws P* and initialisation; the summary is mean +- std
    seeds: tuple[int, ...] = (0, 1, 2)
    num_contexts: Count = 256  # N contexts, each with a free embedding h_c
    num_outcomes: Annotated[int, Interval("[2, inf)")] = 512  # M outcomes (the vocabulary)
    steps: Count = 1000  # full-batch Adam steps per run
    learning_rate: Positive = 0.01  # Adam's learning rate
    num_components: Count = 4  # K of the mixtures (mos, moss, mos_plif, mixtape)
    num_knots: Count = 10_000  # PLIF's knots (Ganea et al.: 10^5 in the paper preset)
    plif_noise: float = 0.0  # std of the noise added to PLIF's initial slopes
    num_hidden: Count = 8  # monotone_mlp's hidden width
    log_every: Count = 100  # steps between lines of metrics.jsonl (and Ctrl-C's checks)
    mesh: str = ""  # e.g. data=4,vocab=2; empty: all devices on data
    out_dir: str = "runs/synthetic"  # results, plots and metrics go here

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.heads or not self.dims or not self.alphas or not self.seeds:
            raise ValueError("heads, dims, alphas and seeds must each name at least one value")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        # Each head's own checks (built abstractly), before a folder is written.
        nn.check_heads(self.heads, **dataclasses.asdict(self))


PRESETS = {
    "smoke": Config(
        heads=("softmax", "plif", "mos"),
        dims=(2, 4),
        seeds=(0, 1),
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


def train_one(
    config: Config, run, head: str, dim: int, alpha: float, seed: int, targets, stop: StopSignals
) -> dict | None:
    """Trains one model full-batch and returns its row of results (``None`` where a signal
    stopped it between two logging intervals)."""
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
        if stop.requested:
            return None
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


METRICS = (
    "mode_matching", "cross_entropy", "kl", "numerical_rank", "effective_rank", "near_tied_modes",
)  # fmt: skip
TABLE_COLUMNS = (
    "alpha", "d", "head", "mode_matching", "cross_entropy", "kl", "numerical_rank", "effective_rank",
)  # fmt: skip
# Decimals of each metric in results.md's mean +- std table.
DECIMALS = {
    "mode_matching": 1, "cross_entropy": 3, "kl": 3, "numerical_rank": 1, "effective_rank": 1,
}  # fmt: skip
PAGE_TEXT = (
    "Mean ± std over the seeds {seeds} (std with ddof = 1; each seed draws its own true laws "
    "P* and initialisation) per alpha, d and head: mode matching in % of contexts, "
    "cross-entropy and KL(P* || P_theta) in nats, numerical and effective (99% energy) rank of "
    "the learned contexts x outcomes log-probability matrix. Every seed's row follows. The "
    "numbers move in the last digit from one machine to another (float32 summation order); "
    "the spread over seeds is the scale to read them on.\n\n"
)


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and std over seeds (ddof = 1; ``None`` for one seed) per (alpha, d, head): each
    metric ``m`` of :data:`METRICS` as ``m`` (the mean) and ``m_std``.

    Example:
      >>> rows = [{"alpha": 0.1, "d": 2, "head": "softmax", "seed": s, **dict.fromkeys(METRICS, v)}
      ...         for s, v in ((0, 1.0), (1, 3.0))]
      >>> row = summarize(rows)[0]
      >>> row["seeds"], row["kl"], row["kl_std"]
      (2, 2.0, 1.4142135623730951)
    """
    groups = defaultdict(list)
    for row in rows:
        groups[(row["alpha"], row["d"], row["head"])].append(row)
    summary = []
    for (alpha, dim, head), group in sorted(groups.items()):
        stats: dict = {}
        for k in METRICS:
            values = np.array([r[k] for r in group], dtype=float)
            stats[k] = float(values.mean())
            stats[f"{k}_std"] = float(values.std(ddof=1)) if len(group) > 1 else None
        summary.append({"alpha": alpha, "d": dim, "head": head, "seeds": len(group), **stats})
    return summary


def mean_std_text(row: dict, metric: str) -> str:
    """``row``'s mean of ``metric`` ± its std over seeds, at :data:`DECIMALS`' precision (the
    mean alone for one seed), as results.md and the README write it.

    Example:
      >>> mean_std_text({"kl": 2.28749, "kl_std": 0.01234}, "kl")
      '2.287 ± 0.012'
    """
    places = DECIMALS[metric]
    std = row.get(f"{metric}_std")
    text = f"{row[metric]:.{places}f}"
    return text if std is None else f"{text} ± {std:.{places}f}"


def page(summary: list[dict], rows: list[dict], seeds: tuple[int, ...]) -> str:
    """results.md's body: the mean ± std table, then every seed's row."""
    means = [
        {
            "alpha": r["alpha"],
            "d": r["d"],
            "head": r["head"],
            "seeds": r["seeds"],
            **{m: mean_std_text(r, m) for m in TABLE_COLUMNS[3:]},
        }
        for r in summary
    ]
    per_seed = sorted(rows, key=lambda r: (r["alpha"], r["d"], r["head"], r["seed"]))
    return (
        PAGE_TEXT.format(seeds=", ".join(map(str, seeds)))
        + markdown_table(means)
        + "\n\nEvery seed:\n\n"
        + markdown_table(per_seed, ("seed", *TABLE_COLUMNS), floatfmt=".4g")
        + "\n"
    )


def plot(summary: list[dict], run, heads: tuple[str, ...]) -> list:
    """One PNG per alpha: mode matching and KL against d, one line per head (the slides' figure)."""
    paths, plt = [], pyplot()
    for alpha in sorted({row["alpha"] for row in summary}):
        fig, (ax_mode, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.2))
        for head in heads:
            rows = sorted(
                (r for r in summary if r["alpha"] == alpha and r["head"] == head),
                key=lambda r: r["d"],
            )
            dims = [r["d"] for r in rows]
            for ax, metric in ((ax_mode, "mode_matching"), (ax_kl, "kl")):
                ax.errorbar(
                    dims,
                    [r[metric] for r in rows],
                    yerr=[r[f"{metric}_std"] or 0.0 for r in rows],
                    marker="o",
                    capsize=3,
                    label=head,
                )
        for ax, ylabel in (
            (ax_mode, "mode matching (%, mean ± std over seeds)"),
            (ax_kl, "KL(P* || P_theta) (nats, mean ± std)"),
        ):
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


# The fields that choose the cells and how often they log: a rerun may change them and keeps
# the rows of the cells it shares with the folder's run (every other field must match).
GRID_FIELDS = ("heads", "dims", "alphas", "seeds", "log_every", "out_dir")


def recorded_rows(config: Config) -> list[dict]:
    """The rows an earlier run in ``--out_dir`` finished, if its settings are this run's but
    for :data:`GRID_FIELDS` (else :class:`RunFolderError`, before anything is written)."""
    check_resumable(config.out_dir, config, may_change=GRID_FIELDS)
    path = Path(config.out_dir) / "results.json"
    return json.loads(path.read_text())["runs"] if path.is_file() else []


def write_outputs(run, rows: list[dict], config: Config) -> list:
    """results.json (rows and summary), results.csv, results.md and the plots of ``rows``."""
    summary = summarize(rows)
    run.write_json("results.json", {"runs": rows, "summary": summary})
    run.write_csv("results.csv", rows)
    seeds = tuple(sorted({r["seed"] for r in rows}))
    title = "Synthetic Dirichlet study (Ganea et al. 2019)"
    grid = grid_cells(config)
    missing = len(set(grid) - {cell_key(r) for r in rows})
    if missing:
        title += f" — partial ({missing} of the grid's {len(grid)} runs to go)"
    run.write_page("results.md", title, page(summary, rows, seeds))
    return plot(summary, run, config.heads)


def grid_cells(config: Config) -> list[tuple]:
    """The grid's runs as (alpha, seed, d, head), in the order they run: a seed's task at a
    time (the task depends on alpha and seed only)."""
    return [
        (a, s, d, h)
        for a in config.alphas
        for s in config.seeds
        for d in config.dims
        for h in config.heads
    ]


def cell_key(row: dict) -> tuple:
    return (row["alpha"], row["seed"], row["d"], row["head"])


def main(argv: list[str] | None = None) -> list[dict]:
    config = parse_config(Config, PRESETS, argv)
    with one_line_errors(config), StopSignals() as stop:
        try:  # this process's devices: checked before the folder is made
            require_data_divides(config.mesh, "num_contexts", config.num_contexts)
        except ValueError as err:
            raise UsageError(str(err)) from None
        rows = recorded_rows(config)
        run = open_run(config.out_dir, config, resume=bool(rows))
        done = {cell_key(r) for r in rows}
        todo = [cell for cell in grid_cells(config) if cell not in done]
        if done:
            print(f"resuming {run.root}: {len(rows)} runs recorded, {len(todo)} to go")
        bar = progress(todo, desc="synthetic")
        for alpha, seed, dim, head in bar:
            bar.set_postfix(head=head, d=dim, alpha=alpha, seed=seed)
            # The task depends on (alpha, seed) only, so every head and d fits the same P*.
            targets = dirichlet_targets(
                jax.random.key(seed), config.num_contexts, config.num_outcomes, alpha
            )
            row = train_one(config, run, head, dim, alpha, seed, targets, stop)
            if row is None:  # stopped by a signal: this run is dropped, the finished ones kept
                break
            rows.append(row)
            # Rewritten after every run, so an interrupted grid keeps what it finished.
            run.write_json("results.json", {"runs": rows})
            run.write_csv("results.csv", rows)
        bar.close()
        paths = write_outputs(run, rows, config) if rows else []
        if stop.requested:
            print(
                f"stopped: {len(rows)} runs kept in {run.root}; rerun the same command to go on",
                file=sys.stderr,
            )
            raise TrainingInterrupted(stop.exit_code)
    print(markdown_table(summarize(rows), TABLE_COLUMNS, floatfmt=".4g"))
    print(
        f"\nwrote {run.root}/results.json, results.md, results.csv, metrics.jsonl, "
        + ", ".join(p.name for p in paths)
    )
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
