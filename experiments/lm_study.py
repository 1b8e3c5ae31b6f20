"""Perplexity against the bottleneck width d for every head: a multi-seed language-model study.

The seeds' central claim (Yang et al. 2018; Kanai et al. 2018; Ganea et al. 2019): a softmax over
``W h`` with ``h`` in R^d gives log-probability matrices of rank <= d + 1, so a head that breaks
the bottleneck (sigsoftmax, PLIF, MoS, MoSS) should lower perplexity, and most where d is small.
This script trains one AWD-LSTM per cell of the grid ``heads x ds x seeds`` with the language
model's own run loop (``experiments/language_model.py``, in-process) and tabulates the result.

Model. A 2-layer AWD-LSTM whose inner width (``--nhid``) is the same in every cell; the last
layer's output, the tied embedding and the head's input all have width ``d`` (``emsize = d``), so
``d`` is the bottleneck and the trunk is shared. Mixture heads decode ``num_components`` latents
``tanh(P_k h)`` of width ``d`` with the same tied decoder (Yang et al.'s MoS), so they add only
``P`` and the prior (``study.json`` reports every cell's parameter count).

Data. PTB with its vocabulary cut to the ``--vocab_size`` most frequent training words (the rest
become ``<unk>``; 2,000 by default, which keeps 82% of the training tokens as words): on 2 CPU
cores the full 10,000 words more than halve the tokens per second of a softmax cell and make
MoS-3 about 4x slower than softmax (1.6x at 2,000 words), too much for 30 cells in two hours
(docs/lm_study.md has the pilot and the arithmetic). The rank bound still binds: d + 2 <= 34
against 2,000 words.

Protocol (the same for every head). AWD-LSTM's SGD (lr 20: Yang et al.'s MoS rate, inside
Merity's range) with NT-ASGD (``--nonmono 1``: average from the first epoch that does not
improve), gradient clipping 0.25, PLIF's slopes at their own rate 0.02 (Ganea et al.); every cell
of a seed sees the same data order, window lengths and dropout stream (they are functions of the
seed); each cell trains until validation perplexity has not improved for ``--patience`` epochs or
until the ``--epochs`` budget ends, whichever comes first: ``stop_reason`` says which. The
best-validation model is evaluated. No head is tuned on its own.

    python experiments/lm_study.py --preset smoke --out_dir /tmp/study    # seconds, fixtures
    python experiments/lm_study.py             # the default grid (PTB downloaded; --data_dir DIR)
    python experiments/lm_study.py --corpus wikitext2 --out_dir runs/lm_study_wt2
    python experiments/lm_study.py --preset full                          # a GPU's grid

Resumable. Every cell is a language-model run folder under ``OUT_DIR/cells/`` with its own
checkpoints: rerunning the command skips finished cells and resumes an unfinished one where it
stopped (Ctrl-C saves and exits). A cell that fails (say, diverges) is recorded with its error and
the grid goes on; rerunning retries it.

Writes to --out_dir: config.json; study.json / study.csv (one row per cell: valid / test
perplexity, epochs, stopping reason, seconds, parameters), study.md (mean +- std per head x d and
the gain over softmax), test_ppl_vs_d.png, learning_curves.png, and for ``--rank_d`` the
numerical / effective rank of each head's test log-probabilities (``rank/<head>/``, via
``experiments/rank.py --mode model``; ``ranks`` in study.json).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import language_model  # noqa: E402
import rank  # noqa: E402

from bottleneck.nn import HEAD_NAMES  # noqa: E402
from bottleneck.train import (  # noqa: E402
    RunDir,
    open_run,
    parse_config,
    print_table,
    to_jsonable,
)
from bottleneck.train.experiment import UsageError, validate_config  # noqa: E402
from bottleneck.train.lm_config import (  # noqa: E402
    DataConfig,
    EvaluationConfig,
    HeadConfig,
    OptimizerConfig,
    TrainingConfig,
)
from bottleneck.train.run_loop import TrainingDiverged  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    """A grid of AWD-LSTM language models: heads x bottleneck widths d x seeds."""

    heads: tuple[str, ...] = ("softmax", "sigsoftmax", "plif", "mos", "moss")
    ds: tuple[int, ...] = dataclasses.field(
        default=(8, 16, 32), metadata={"help": "bottleneck widths d (emsize = head input)"}
    )
    seeds: tuple[int, ...] = (1, 2)
    corpus: str = dataclasses.field(default="ptb", metadata={"help": "ptb | wikitext2"})
    data_dir: str | None = dataclasses.field(
        default=None, metadata={"help": "folder with the release files; none: download"}
    )
    vocab_size: int | None = dataclasses.field(
        default=2000, metadata={"help": "most frequent training words kept, others <unk>"}
    )
    # the model (the same trunk in every cell)
    nhid: int = 128
    nlayers: int = 2
    num_components: int = dataclasses.field(default=3, metadata={"help": "K of mos / moss"})
    num_knots: int = dataclasses.field(default=10_000, metadata={"help": "PLIF knots"})
    dropout: float = 0.1
    dropouth: float = 0.1
    dropouti: float = 0.1
    dropoute: float = 0.0
    wdrop: float = 0.1
    # training (the same protocol for every head)
    optimizer: str = dataclasses.field(default="sgd", metadata={"help": "sgd (NT-ASGD) | adam"})
    lr: float = 20.0
    plif_lr: float = dataclasses.field(default=0.02, metadata={"help": "PLIF slopes' own lr"})
    batch_size: int = 64
    bptt: int = 35
    nonmono: int = dataclasses.field(
        default=1, metadata={"help": "NT-ASGD: average after N epochs without improvement"}
    )
    train_tokens: int | None = dataclasses.field(
        default=None, metadata={"help": "first N training tokens only; none: all"}
    )
    eval_tokens: int | None = dataclasses.field(
        default=None, metadata={"help": "first N validation / test tokens only; none: all"}
    )
    epochs: int = dataclasses.field(default=2, metadata={"help": "budget per cell"})
    patience: int = dataclasses.field(default=2, metadata={"help": "early-stopping patience"})
    # the rank analysis
    rank_d: int | None = dataclasses.field(
        default=8, metadata={"help": "d whose first seed's test log-probs are ranked; none: skip"}
    )
    rank_tokens: int = dataclasses.field(default=4000, metadata={"help": "test rows ranked"})
    rank_vocab: int = dataclasses.field(
        default=4000, metadata={"help": "vocabulary columns ranked (a random subset if fewer)"}
    )
    out_dir: str = "runs/lm_study"

    def validate(self) -> None:
        unknown = [h for h in self.heads if h not in HEAD_NAMES]
        if unknown:
            raise ValueError(f"unknown head(s) {unknown}; choose from {', '.join(HEAD_NAMES)}")
        if not self.heads or not self.ds or not self.seeds:
            raise ValueError("heads, ds and seeds must each name at least one value")
        for name in ("heads", "ds", "seeds"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has repeated values: {values}")
        if min(self.ds) < 1:
            raise ValueError(f"every d must be >= 1, got {self.ds}")
        if self.rank_d is not None and self.rank_d not in self.ds:
            raise ValueError(f"rank_d {self.rank_d} is not one of ds {self.ds}")
        for name in ("rank_tokens", "rank_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # Everything else is checked by the language model's own Config, for every cell, now.
        for head in self.heads:
            validate_config(cell_config(self, head, self.ds[0], self.seeds[0]))


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds: the fixture corpus, a tiny trunk, every stage (resume, rank, table, plots).
    "smoke": {
        "data_dir": str(language_model.FIXTURES_DIR),
        "heads": ("softmax", "mos"),
        "ds": (4,),
        "seeds": (1,),
        "nhid": 16,
        "num_components": 2,
        "num_knots": 100,
        "batch_size": 2,
        "bptt": 3,
        "lr": 1.0,
        "epochs": 2,
        "train_tokens": 200,
        "eval_tokens": 100,
        "rank_d": 4,
        "rank_tokens": 50,
        "rank_vocab": 50,
    },
    # For a GPU: the seeds' heads at wider bottlenecks, three seeds, a longer budget.
    "full": {
        "heads": ("softmax", "sigsoftmax", "plif", "mos", "moss", "mos_plif", "monotone_mlp"),
        "ds": (16, 32, 64, 128, 256),
        "seeds": (1, 2, 3),
        "vocab_size": None,
        "nhid": 512,
        "nlayers": 3,
        "num_components": 8,
        "num_knots": 100_000,
        "epochs": 40,
        "patience": 3,
        "rank_d": 64,
        "rank_tokens": 20_000,
        "rank_vocab": 10_000,
    },
}


# ----------------------------------------------------------------------------------------------


def cell_name(head: str, d: int, seed: int) -> str:
    return f"{head}-d{d}-s{seed}"


def cell_config(config: Config, head: str, d: int, seed: int) -> language_model.Config:
    """The language-model config of one cell (its own folder; the prepared corpus is shared)."""
    root = Path(config.out_dir)
    ranked = head in config.heads and d == config.rank_d and seed == config.seeds[0]
    return language_model.Config(
        data=DataConfig(
            corpus=config.corpus,
            data_dir=config.data_dir,
            tfds_dir=str(root / "tfds"),
            vocab_size=config.vocab_size,
            train_tokens=config.train_tokens,
            eval_tokens=config.eval_tokens,
            batch_size=config.batch_size,
            eval_batch_size=config.batch_size,
            bptt=config.bptt,
        ),
        awd_lstm=language_model.AWDLSTMConfig(
            emsize=d,
            nhid=config.nhid,
            nlayers=config.nlayers,
            dropout=config.dropout,
            dropouth=config.dropouth,
            dropouti=config.dropouti,
            dropoute=config.dropoute,
            wdrop=config.wdrop,
        ),
        head=HeadConfig(head, num_components=config.num_components, num_knots=config.num_knots),
        optimizer=OptimizerConfig(
            config.optimizer, lr=config.lr, plif_lr=config.plif_lr, nonmono=config.nonmono
        ),
        training=TrainingConfig(epochs=config.epochs, patience=config.patience),
        evaluation=EvaluationConfig(
            test_batch_size=config.batch_size,
            max_logprob_tokens=config.rank_tokens if ranked else 0,
        ),
        seed=seed,
        out_dir=str(root / "cells" / cell_name(head, d, seed)),
    )


def finished_results(cell: language_model.Config) -> dict[str, Any] | None:
    """The cell's results if it finished with exactly this config (else it must run or resume)."""
    root = Path(cell.out_dir)
    if not (root / "results.json").is_file() or not (root / "config.json").is_file():
        return None
    if json.loads((root / "config.json").read_text()).get("config") != to_jsonable(cell):
        return None  # e.g. a longer --epochs budget: the cell resumes from its checkpoint
    return json.loads((root / "results.json").read_text())


def run_cell(cell: language_model.Config) -> dict[str, Any]:
    """Trains (or resumes) one cell; a finished cell is read back, a failure is recorded."""
    results = finished_results(cell)
    if results is not None:
        return {"status": "done", **results}
    try:
        results = language_model.run_experiment(cell)
    except (UsageError, TrainingDiverged) as err:
        print(f"cell {Path(cell.out_dir).name} failed: {err}", file=sys.stderr)
        return {"status": "failed", "error": str(err)}
    return {"status": "done", **results}


def learning_curve(cell: language_model.Config) -> list[dict[str, Any]]:
    path = Path(cell.out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("event") == "epoch"]


def cell_row(head: str, d: int, seed: int, results: dict[str, Any], curve: list) -> dict:
    row: dict[str, Any] = {"head": head, "d": d, "seed": seed, "status": results["status"]}
    if results["status"] != "done":
        return {**row, "error": results["error"]}
    return {
        **row,
        "valid_ppl": results["valid_ppl"],
        "test_ppl": results["test_ppl"],
        "epochs": results["epochs_trained"],
        "best_epoch": 1 + int(np.argmin([r["valid_loss"] for r in curve])) if curve else None,
        "stop_reason": results["stop_reason"],
        "train_seconds": sum(r["seconds"] for r in curve),
        "seconds_per_epoch": results["seconds_per_epoch"],
        "params": results["num_params"],
    }


def summarize(rows: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Mean +- std over seeds per head x d, and the gain over softmax at the same d."""
    done = [r for r in rows if r["status"] == "done"]
    table = []
    for d in config.ds:
        base = [r["test_ppl"] for r in done if r["head"] == "softmax" and r["d"] == d]
        for head in config.heads:
            cells = [r for r in done if r["head"] == head and r["d"] == d]
            if not cells:
                continue
            test = np.array([r["test_ppl"] for r in cells])
            valid = np.array([r["valid_ppl"] for r in cells])
            entry = {
                "d": d,
                "head": head,
                "seeds": len(cells),
                "test_ppl": float(test.mean()),
                "test_std": float(test.std(ddof=1)) if len(cells) > 1 else None,
                "valid_ppl": float(valid.mean()),
                "epochs": float(np.mean([r["epochs"] for r in cells])),
                "early_stopped": sum(r["stop_reason"].startswith("early") for r in cells),
                "s_per_epoch": float(np.median([r["seconds_per_epoch"] for r in cells])),
                "params": cells[0]["params"],
            }
            if base and head != "softmax":
                gain = float(np.mean(base)) - entry["test_ppl"]
                entry["gain_ppl"] = gain
                entry["gain_pct"] = 100.0 * gain / float(np.mean(base))
            table.append(entry)
    return table


def markdown(table: list[dict[str, Any]], rows: list[dict[str, Any]], config: Config) -> str:
    lines = [
        f"# LM study: {config.corpus}, heads x d x seeds {list(config.seeds)}",
        "",
        "Test perplexity of the best-validation model, mean ± std over seeds; gain = softmax's "
        "mean test perplexity at the same d minus the head's (positive: better than softmax). "
        f"Budget {config.epochs} epochs per cell, early stopping with patience {config.patience}; "
        "'stopped early' counts the seeds whose validation perplexity stopped improving before "
        "the budget ended.",
        "",
        "| d | head | test ppl | gain (ppl) | gain (%) | valid ppl | epochs | stopped early "
        "| s/epoch | params |",
        "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for e in table:
        std = f" ± {e['test_std']:.1f}" if e["test_std"] is not None else ""
        gain = f"{e['gain_ppl']:+.1f}" if "gain_ppl" in e else "—"
        pct = f"{e['gain_pct']:+.1f}" if "gain_pct" in e else "—"
        lines.append(
            f"| {e['d']} | {e['head']} | {e['test_ppl']:.1f}{std} | {gain} | {pct} | "
            f"{e['valid_ppl']:.1f} | {e['epochs']:.1f} | {e['early_stopped']}/{e['seeds']} | "
            f"{e['s_per_epoch']:.0f} | {e['params']:,} |"
        )
    failed = [r for r in rows if r["status"] != "done"]
    if failed:
        lines += ["", "Failed cells (rerun the command to retry them):", ""]
        lines += [f"- {cell_name(r['head'], r['d'], r['seed'])}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def plot_vs_d(table: list[dict[str, Any]], config: Config, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for head in config.heads:
        entries = [e for e in table if e["head"] == head]
        if not entries:
            continue
        ax.errorbar(
            [e["d"] for e in entries],
            [e["test_ppl"] for e in entries],
            yerr=[e["test_std"] or 0.0 for e in entries],
            marker="o",
            capsize=3,
            label=head,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(config.ds), [str(d) for d in config.ds])
    ax.set_xlabel("d (head input width: the bottleneck)")
    ax.set_ylabel("test perplexity (mean ± std over seeds)")
    ax.set_title(f"{config.corpus}: perplexity against the bottleneck width")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(curves: dict[tuple[str, int, int], list], config: Config, path: Path) -> None:
    fig, axes = plt.subplots(
        1, len(config.ds), figsize=(4.2 * len(config.ds), 3.8), squeeze=False, sharey=False
    )
    colors = {head: f"C{i}" for i, head in enumerate(config.heads)}
    for ax, d in zip(axes[0], config.ds, strict=True):
        for (head, cd, seed), curve in curves.items():
            if cd != d or not curve:
                continue
            ax.plot(
                [r["epoch"] for r in curve],
                [r["valid_ppl"] for r in curve],
                color=colors[head],
                ls="-" if seed == config.seeds[0] else "--",
                marker=".",
                label=head if seed == config.seeds[0] else None,
            )
        ax.set_title(f"d = {d}")
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation perplexity")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{config.corpus}: learning curves (line style: seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rank_cells(config: Config, run: RunDir) -> list[dict[str, Any]]:
    """Numerical and effective rank of each head's test log-probs at ``rank_d`` (Kanai Table 3)."""
    ranks = []
    for head in config.heads:
        cell = cell_config(config, head, config.rank_d, config.seeds[0])
        log_probs = Path(cell.out_dir) / "log_probs"
        if not log_probs.is_dir():
            continue
        (row,) = rank.main(
            [
                "--mode", "model",
                "--log_probs", str(log_probs),
                "--hidden_size", str(config.rank_d),
                "--max_vocab", str(config.rank_vocab),
                "--max_tokens", str(config.rank_tokens),
                "--out_dir", str(run.root / "rank" / head),
            ]
        )  # fmt: skip
        ranks.append({"head": head, "d": config.rank_d, **row})
    return ranks


def run_study(config: Config) -> dict[str, Any]:
    root = Path(config.out_dir)
    run = open_run(root, config, resume=True)
    start = time.perf_counter()
    rows, curves = [], {}
    cells = [(h, d, s) for s in config.seeds for d in config.ds for h in config.heads]
    for i, (head, d, seed) in enumerate(cells):
        cell = cell_config(config, head, d, seed)
        print(f"\n=== cell {i + 1}/{len(cells)}: {cell_name(head, d, seed)} ===", flush=True)
        results = run_cell(cell)
        curves[(head, d, seed)] = learning_curve(cell)
        rows.append(cell_row(head, d, seed, results, curves[(head, d, seed)]))
    table = summarize(rows, config)
    ranks = rank_cells(config, run) if config.rank_d is not None else []
    study = {
        "corpus": config.corpus,
        "cells": rows,
        "summary": table,
        "ranks": ranks,
        "train_seconds_total": sum(r.get("train_seconds", 0.0) for r in rows),
        "seconds_this_invocation": time.perf_counter() - start,
    }
    run.write_json("study.json", study)
    run.write_csv("study.csv", rows)
    text = markdown(table, rows, config)
    if ranks:
        text += (
            f"\nRank of the test log-probability matrix at d = {config.rank_d} "
            f"({ranks[0]['rows_analysed']} tokens x {ranks[0]['columns_analysed']} words; d + 2 = "
            f"{config.rank_d + 2}):\n\n| head | numerical rank | effective rank (99%) |\n"
            "|---|--:|--:|\n"
        )
        text += "".join(
            f"| {r['head']} | {r['numerical_rank']} | {r['effective_rank']} |\n" for r in ranks
        )
    run.path("study.md").write_text(text)
    plot_vs_d(table, config, run.path("test_ppl_vs_d.png"))
    plot_curves(curves, config, run.path("learning_curves.png"))
    print_table(
        [{k: e.get(k) for k in ("d", "head", "test_ppl", "test_std", "gain_pct")} for e in table],
        floatfmt=".2f",
    )
    failed = sum(r["status"] != "done" for r in rows)
    print(
        f"\nwrote {root}/: study.json, study.csv, study.md, test_ppl_vs_d.png, "
        f"learning_curves.png{', rank/' if ranks else ''}"
        + (f"\n{failed} cell(s) failed; rerun the same command to retry them" if failed else "")
    )
    return study


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(Config, PRESETS, argv)
    study = run_study(config)
    if any(r["status"] != "done" for r in study["cells"]):
        raise SystemExit(1)
    return study


if __name__ == "__main__":
    main(sys.argv[1:])
