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
        [--embedding factorized|fixed] [--baseline OTHER_CHECKOUT] [--preload ALLOCATOR.so]
        [--out benchmarks/results/study_step.json]

``--baseline DIR`` (e.g. ``git worktree add /tmp/baseline COMMIT``) times every cell's step with
that checkout's library too, in the same run: a second worker process, its calls interleaved
with the first's, and the table gains each cell's ratio to itself there. ``--preload LIB``
(e.g. ``/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4``) does the same with this checkout's
library in a process started with ``LD_PRELOAD=LIB``: another memory allocator, the same code.
Every version's steps run in the same order on the same window from the same initial state, so
each also says whether its losses equal this checkout's bit for bit (an allocator must not
change them; another commit may by round-off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
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
    """Reads cells ``head@d`` on stdin; answers the first ask of each with its step's loss
    (built and compiled) and every later one with its step's milliseconds and loss, as a JSON
    line each."""
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
            metrics = jax.block_until_ready(calls[cell]())
            print(json.dumps({"loss": float(metrics.loss)}), flush=True)
            continue
        start = time.perf_counter()
        metrics = jax.block_until_ready(calls[cell]())
        ms = 1e3 * (time.perf_counter() - start)
        print(json.dumps({"ms": ms, "loss": float(metrics.loss)}), flush=True)


def timed_by_workers(
    args: argparse.Namespace, cells: list[str], counts: np.ndarray
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[float]]], dict[str, str]]:
    """Each cell's step with this checkout's library (and ``--baseline``'s, and this one's under
    ``--preload``), each version in a worker process of its own, the calls interleaved:
    ``{"now": times[, "baseline": times][, "preload": times]}``, each version's losses of
    every step (the compiling one first) in the same shape, and each version's commit."""
    counts_path = args.out.with_suffix(".counts.npy")
    counts_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(counts_path, counts)
    versions = {"now": (CHECKOUT, {})}
    if args.baseline is not None:
        versions["baseline"] = (args.baseline.resolve(), {})
    if args.preload is not None:
        versions["preload"] = (CHECKOUT, {"LD_PRELOAD": str(args.preload.resolve())})
    options = (counts_path, args.shared_gate_below, args.memory_budget_mib, args.embedding)
    workers = {
        name: Worker(root, __file__, *options, env=env) for name, (root, env) in versions.items()
    }
    times: dict[str, dict[str, list[float]]] = {name: {c: [] for c in cells} for name in versions}
    losses: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cells} for n in versions}
    order = [(name, cell) for cell in cells for name in versions]
    with tqdm(total=len(order) * (args.repeats + 1), desc="study steps") as progress:
        for name, cell in order:
            losses[name][cell].append(workers[name].ask(cell)["loss"])
            progress.update()
        for repetition in range(args.repeats):
            for name, cell in order if repetition % 2 == 0 else reversed(order):
                answer = workers[name].ask(cell)
                times[name][cell].append(answer["ms"])
                losses[name][cell].append(answer["loss"])
                progress.update()
    for w in workers.values():
        w.close()
    counts_path.unlink()
    return times, losses, {name: commit_of(root) for name, (root, _) in versions.items()}


def same_losses(losses: Sequence[float], reference: Sequence[float]) -> str:
    """``yes`` where every step's loss equals the reference's bit for bit, else the largest
    relative difference."""
    if list(losses) == list(reference):
        return "yes"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    return f"no ({worst:.1e})"


def comparison_columns(
    other: Mapping[str, list[float]], ratios: Mapping[str, float],
    losses: Mapping[str, list[float]], other_losses: Mapping[str, list[float]], cells: list[str],
) -> list[list[str]]:  # fmt: skip
    """Per cell, the columns comparing another version's steps (``other``) with this checkout's:
    its median ms, the caller's ratio of the two, its ratio to softmax there, and whether its
    losses equal this checkout's."""
    rows = []
    for cell in cells:
        softmax = other[f"softmax@{cell.split('@')[1]}"]
        rows.append([
            f"{statistics.median(other[cell]):.1f}",
            f"{ratios[cell]:.2f}",
            f"{median_ratio(other[cell], softmax):.2f}",
            same_losses(other_losses[cell], losses[cell]),
        ])  # fmt: skip
    return rows


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
    parser.add_argument(
        "--preload", type=Path,
        help="a shared library (a memory allocator) under which this checkout's steps also run",
    )  # fmt: skip
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
    if args.preload is not None and not args.preload.is_file():
        parser.error(f"--preload {args.preload}: no such file")

    data = study.trunk.data
    steps_per_epoch = data.steps_per_epoch(np.zeros(PTB_TRAIN_TOKENS, np.int32), SEED)
    counts, counts_source = token_counts(args.data_dir, VOCAB)
    cells = [f"{head}@{d}" for d in ds for head in heads]
    versions, losses, commits = timed_by_workers(args, cells, counts)
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
    # Each other version: its columns' names, its ratio to this checkout's step, its sentence.
    comparisons = []
    if "baseline" in versions:
        before = versions["baseline"]
        comparisons.append((
            "baseline",
            [f"ms at {commits['baseline']}", "x baseline", "x softmax there", "same losses"],
            {c: median_ratio(times[c], before[c]) for c in cells},
            f" Against {commits['baseline']}: the same steps with that checkout's library, each "
            "version in a worker process of its own, the calls interleaved; x baseline: the "
            "median ratio of the step to the same cell's there.",
        ))  # fmt: skip
    if "preload" in versions:
        preloaded, lib = versions["preload"], args.preload.name
        comparisons.append((
            "preload",
            [f"ms with {lib}", f"x with {lib}", f"x softmax with {lib}", "same losses"],
            {c: median_ratio(preloaded[c], times[c]) for c in cells},
            f" With {args.preload}: the same steps with this checkout's library in a worker "
            f"process started with LD_PRELOAD set to it, interleaved likewise; x with {lib}: the "
            "median ratio of its step to the same cell's without it.",
        ))  # fmt: skip
    against = ""
    for name, names, ratios_there, sentence in comparisons:
        header += names
        extra = comparison_columns(versions[name], ratios_there, losses["now"], losses[name], cells)
        rows = [row + more for row, more in zip(rows, extra, strict=True)]
        against += sentence
    if against:
        against += (
            " same losses: whether that version's loss at every step (the same steps in the "
            "same order) equals this checkout's bit for bit, else the largest relative difference."
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
            "preload": None if args.preload is None else str(args.preload),
            "preload_times_ms": versions.get("preload"),
            "losses": losses,
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
