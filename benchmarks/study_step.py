"""The converged study's cost per head and bottleneck width d, on one machine in one run.

``experiments/lm_study.py`` records each cell's seconds per epoch, but its cells ran over days,
on more than one machine and beside other work, so those columns do not compare heads. This
times one training step of every cell's model as the grid trains it (the study's Transformer
trunk with the cell's head at width ``d``, AdamW with the cell's schedule, dropout on; built
by ``experiments/language_model.py`` from ``lm_study.cell_config``) on one window of the
study's shape (32 sequences x 64 tokens, PTB's 10,000 words), every cell in one worker process
with this checkout's library (``_timing.Worker``, as ``head_cost.py``), the calls interleaved.
The table gives each cell's median milliseconds per
step, its ratio to softmax at the same ``d`` (the median of per-repetition ratios), and the
seconds of an epoch's training steps (the step times the windows of PTB's first epoch at
seed 1; the validation pass after each epoch, about a twentieth of it, is not counted).

Run from the repository root (about 5 minutes on 2 cores, alone on the machine):

    python benchmarks/study_step.py [--heads softmax,mos,mixtape_shared] [--ds 16,32,64,128]
        [--repeats 5] [--data_dir PTB_DIR] [--shared-gate-below 100] [--memory-budget-mib 32]
        [--embedding factorized|fixed] [--baseline OTHER_CHECKOUT]
        [--out benchmarks/results/study_step.json]

``--baseline DIR`` (e.g. ``git worktree add /tmp/baseline COMMIT``) times every cell's step with
that checkout's library too, in the same run: a second worker process, its calls interleaved
with the first's, and the table gains each cell's ratio to itself there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _shapes import random_window, token_counts
from _timing import (
    CHECKOUT,
    Worker,
    commit_of,
    machine_info,
    markdown_table,
    median_ratio,
    medians,
    worker_cases,
    write_results,
)
from tqdm import tqdm

from bottleneck.runs import language_model, lm_study
from bottleneck.train import Trainer
from bottleneck.train.lm import Window

VOCAB = 10_000
# PTB's training split in tokens (ptb.train.txt's words and one end of sentence per line): the
# length of the stream the study's windows are cut from.
PTB_TRAIN_TOKENS = 929_589
SEED = 1


# The study's heads, and Mixtape as its paper runs it: words seen fewer than
# --shared-gate-below times share one gate.
SHARED_MIXTAPE = "mixtape_shared"


def step_call(
    head: str, d: int, window: Window, counts: np.ndarray, shared_gate_below: float,
    memory_budget_mib: float | None, embedding: str,
) -> Callable[[], Any]:  # fmt: skip
    """A zero-argument call running one training step of cell ``(head, d)``'s model."""
    preset = "mixtape" if head == SHARED_MIXTAPE else head
    with tempfile.TemporaryDirectory() as folder:  # cell_config names folders; none is written
        study = lm_study.Config(out_dir=folder, embedding=embedding)
        cell = lm_study.cell_config(study, preset, d, SEED)
    sharing = {"shared_gate_below": shared_gate_below} if head == SHARED_MIXTAPE else {}
    cell = dataclasses.replace(
        cell, head=dataclasses.replace(cell.head, memory_budget_mib=memory_budget_mib, **sharing)
    )
    model = language_model.build_model(cell, VOCAB, counts if sharing else None)
    tx = cell.optimizer.transformation(plif=cell.head.uses_plif, total_steps=10_000)
    trainer = Trainer(model, tx, seed=SEED)
    carry = trainer.initial_carry(window.inputs.shape[0])

    def call() -> Any:
        # The metrics come out of the same compiled step as the new state: waiting on them
        # waits for the whole step.
        return trainer.window_step(carry, window, 1.0, averaging=False)[1]

    return call


def worker(counts_path: str, shared_gate_below: str, budget: str, embedding: str) -> None:
    """Reads cells ``head@d`` on stdin; answers the first ask of each with ``{}`` (built and
    compiled) and every later one with one step's milliseconds, as a JSON line each."""
    import jax

    counts = np.load(counts_path)
    data = lm_study.Config().trunk.data
    window = random_window(VOCAB, data.batch_size, data.bptt)
    calls: dict[str, Callable[[], Any]] = {}
    for cell in worker_cases():
        if cell not in calls:
            head, d = cell.split("@")
            calls[cell] = step_call(
                head, int(d), window, counts, float(shared_gate_below),
                None if budget == "None" else float(budget), embedding,
            )  # fmt: skip
            jax.block_until_ready(calls[cell]())
            print("{}", flush=True)
            continue
        start = time.perf_counter()
        jax.block_until_ready(calls[cell]())
        print(json.dumps({"ms": 1e3 * (time.perf_counter() - start)}), flush=True)


def timed_by_workers(
    args: argparse.Namespace, cells: list[str], counts: np.ndarray
) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Each cell's step with this checkout's library (and ``--baseline``'s), each version in a
    worker process of its own, the calls interleaved: ``{"now": times[, "baseline": times]}``
    and each version's commit."""
    counts_path = args.out.with_suffix(".counts.npy")
    counts_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(counts_path, counts)
    roots = {"now": CHECKOUT}
    if args.baseline is not None:
        roots["baseline"] = args.baseline.resolve()
    options = (counts_path, args.shared_gate_below, args.memory_budget_mib, args.embedding)
    workers = {name: Worker(root, __file__, *options) for name, root in roots.items()}
    times: dict[str, dict[str, list[float]]] = {name: {c: [] for c in cells} for name in roots}
    order = [(name, cell) for cell in cells for name in roots]
    with tqdm(total=len(order) * (args.repeats + 1), desc="study steps") as progress:
        for name, cell in order:
            workers[name].ask(cell)
            progress.update()
        for repetition in range(args.repeats):
            for name, cell in order if repetition % 2 == 0 else reversed(order):
                times[name][cell].append(workers[name].ask(cell)["ms"])
                progress.update()
    for w in workers.values():
        w.close()
    counts_path.unlink()
    return times, {name: commit_of(root) for name, root in roots.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
        return
    study = lm_study.Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=",".join(study.heads))
    parser.add_argument("--ds", default=",".join(map(str, study.ds)), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shared-gate-below", type=float, default=100.0, help="mixtape_shared")
    parser.add_argument("--data_dir", type=Path, help="PTB's folder, for mixtape_shared's counts")
    parser.add_argument(
        "--memory-budget-mib", type=float, help="every head's loss chunk budget (default 32)"
    )
    parser.add_argument(
        "--embedding", choices=("factorized", "fixed"), default="factorized",
        help="the study's trunk: factorized (the first grid's) or fixed across d",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=Path, help="a checkout whose library's steps run interleaved with these"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/study_step.json"))
    args = parser.parse_args()
    heads = [name.strip() for name in args.heads.split(",") if name.strip()]
    if "softmax" not in heads:
        parser.error("--heads must include softmax, the reference of the ratios")
    known = (*study.heads, SHARED_MIXTAPE)
    for name in heads:
        if name not in known:
            parser.error(f"unknown head {name!r}; choose from {', '.join(known)}")
    try:
        ds = [int(d) for d in args.ds.split(",")]
    except ValueError:
        parser.error(f"--ds must be comma-separated integers, got {args.ds!r}")
    if any(d < 1 for d in ds):
        parser.error(f"--ds must be >= 1, got {args.ds!r}")
    if args.baseline is not None and not (args.baseline / "bottleneck").is_dir():
        parser.error(f"--baseline {args.baseline} has no bottleneck/ package")

    data = study.trunk.data
    steps_per_epoch = data.steps_per_epoch(np.zeros(PTB_TRAIN_TOKENS, np.int32), SEED)
    counts, counts_source = token_counts(args.data_dir, VOCAB)
    cells = [f"{head}@{d}" for d in ds for head in heads]
    versions, commits = timed_by_workers(args, cells, counts)
    times = versions["now"]
    ms = medians(times)
    ratios = {
        cell: median_ratio(times[cell], times[f"softmax@{cell.split('@')[1]}"]) for cell in cells
    }
    header = ["d", "head", "ms/step", "x softmax", "s/epoch"]
    rows = [
        [*cell.split("@")[::-1], f"{ms[cell]:.1f}", f"{ratios[cell]:.2f}",
         f"{ms[cell] * steps_per_epoch / 1e3:.0f}"]
        for cell in cells
    ]  # fmt: skip
    against = ""
    if "baseline" in versions:
        before = versions["baseline"]
        header += [f"ms at {commits['baseline']}", "x baseline", "x softmax there"]
        for row, cell in zip(rows, cells, strict=True):
            softmax = before[f"softmax@{cell.split('@')[1]}"]
            row += [
                f"{statistics.median(before[cell]):.1f}",
                f"{median_ratio(times[cell], before[cell]):.2f}",
                f"{median_ratio(before[cell], softmax):.2f}",
            ]
        against = (
            f" Against {commits['baseline']}: the same steps with that checkout's library, each "
            "version in a worker process of its own, the calls interleaved; x baseline: the "
            "median ratio of the step to the same cell's there."
        )
    markdown = (
        f"# The study's training step per head and d ({data.batch_size} x {data.bptt} tokens, "
        f"{VOCAB} words)\n\nMedian ms per step over {args.repeats} interleaved repetitions; x "
        f"softmax: median ratio to softmax's step at the same d; s/epoch: the step times "
        f"{steps_per_epoch} windows (PTB's first epoch at seed {SEED}), validation not "
        f"counted. {SHARED_MIXTAPE}: words seen < {args.shared_gate_below:g} times share one "
        f"gate ({int(np.sum(counts >= args.shared_gate_below))} with their own; counts: "
        f"{counts_source}). Loss chunk budget: {args.memory_budget_mib or 32:g} MiB. Trunk: "
        f"{args.embedding} embedding.{against}\n\n" + markdown_table(header, rows)
    )
    write_results(
        args.out,
        {
            "heads": heads,
            "ds": ds,
            "batch_size": data.batch_size,
            "bptt": data.bptt,
            "vocab": VOCAB,
            "steps_per_epoch": steps_per_epoch,
            "median_ms": ms,
            "ratio_to_softmax": ratios,
            "times_ms": times,
            "baseline_times_ms": versions.get("baseline"),
            "commits": commits,
            "trunk": dataclasses.asdict(study.trunk.model),
            "shared_gate_below": args.shared_gate_below,
            "token_counts": counts_source,
            "memory_budget_mib": args.memory_budget_mib,
            "embedding": args.embedding,
            "machine": machine_info(),
        },
        markdown,
        commit=commits["now"],
    )
    print(markdown)


if __name__ == "__main__":
    main()
