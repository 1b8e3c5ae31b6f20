"""Every head's loss against its own cost at an earlier commit, and against softmax, in one run.

Times the jit-compiled forward + backward pass of ``head.loss(h, labels)`` (gradients for every
parameter of the head and for ``h``) for each head at three batch shapes, with the code of this
checkout and, in the same run, with the code of an earlier checkout (``--baseline DIR``, e.g.
``git worktree add /tmp/baseline 8931464``). Each code version runs in a worker process of its
own (a package cannot be imported twice in one process), and the parent interleaves the
calls: repetition after repetition, every case of every version once, so load drifts hit all
alike; ratios are medians of per-repetition ratios. ``--runs N`` repeats the whole run with
fresh worker processes: the same code's times move more between runs than within one (softmax's
study32 loss took 25 ms in one run and 34 ms in another on the same idle machine), so each value
is then the median over the runs, with the runs' range beside it.

Shapes: the study's training window (32 x 64 = 2,048 tokens, 10,000 words) at ``d = 32`` and
128, and Merity et al.'s PTB batch (20 x 70 = 1,400 tokens) at ``d = 400``. Heads: softmax,
sigsoftmax, PLIF (10^4 knots, as the study), MoS (K = 4, linear latents, as the study),
Mixtape (K = 4) without gate sharing (as the first study ran it) and with it (the paper's
Mixtape: the words seen fewer than ``--shared-gate-below`` times in PTB's training split share
one gate; with ``--data_dir`` the counts are PTB's own, otherwise a Zipf law over 10,000 words,
said in the results). Memory: the compiled temporaries of each pass
(``compiled.memory_analysis()``) as a fraction of the full float32 logits ``[N, M]``.

Run from the repository root (about 10 minutes on 2 cores, alone on the machine):

    python benchmarks/head_cost.py --baseline /tmp/baseline [--data_dir PTB_DIR]
        [--heads softmax,mixtape_shared] [--shapes study32,study128,merity400] [--repeats 7]
        [--runs 3] [--out benchmarks/results/head_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _shapes import HEADS, cost_head, loss_and_gradients, token_counts
from _timing import Worker, commit_of, machine_info, median_ratio, worker_cases, write_results

SHAPES = {  # name: (tokens, d, vocabulary)
    "study32": (2048, 32, 10_000),
    "study128": (2048, 128, 10_000),
    "merity400": (1400, 400, 10_000),
}
# Targets of the head-cost issue at the study's batch (ratios of medians in one run).
LOSS_TARGETS = {"vs_baseline": 0.85, "mixtape_shared_vs_softmax": 2.0, "mixtape_shared_vs_mos": 0.6}
PLIF_LOSS_TARGET = 1.8
MEMORY_TARGET = 0.25


# ---- the worker: one code version, one process ----


def worker(counts_path: str, threshold: float) -> None:
    """Reads case names on stdin, answers each with one timing (ms) as a JSON line."""
    import jax

    counts = np.load(counts_path)
    compiled: dict[str, Any] = {}

    def build(case: str) -> Any:
        head_name, shape_name = case.split("@")
        tokens, d, vocab = SHAPES[shape_name]
        fn, state = loss_and_gradients(cost_head(head_name, d, vocab, counts, threshold))
        h = jax.random.normal(jax.random.key(0), (tokens, d))
        labels = jax.random.randint(jax.random.key(1), (tokens,), 0, vocab)
        temp = fn.lower(state, h, labels).compile().memory_analysis()
        value = float(jax.block_until_ready(fn(state, h, labels))[0])
        memory = None if temp is None else temp.temp_size_in_bytes / (tokens * vocab * 4)
        return fn, (state, h, labels), value, memory

    for case in worker_cases():
        if case not in compiled:
            fn, args, value, memory = build(case)
            compiled[case] = (fn, args)
            print(json.dumps({"value": value, "memory": memory}), flush=True)
            continue
        fn, args = compiled[case]
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        print(json.dumps({"ms": 1e3 * (time.perf_counter() - start)}), flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    here = Path(__file__).resolve().parent.parent
    versions = {"now": here}
    if args.baseline is not None:
        versions["baseline"] = args.baseline.resolve()
    counts, source = token_counts(args.data_dir, 10_000)
    counts_path = Path(args.out).with_suffix(".counts.npy")
    counts_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(counts_path, counts)
    cases = [f"{head}@{shape}" for shape in args.shapes for head in args.heads]
    workers = {
        name: Worker(root, __file__, counts_path, args.shared_gate_below)
        for name, root in versions.items()
    }
    built = {(v, c): w.ask(c) for c in cases for v, w in workers.items()}
    times: dict[str, dict[str, list[float]]] = {v: {c: [] for c in cases} for v in versions}
    for repetition in range(args.repeats):
        order = [(v, c) for c in cases for v in versions]
        for version, case in order if repetition % 2 == 0 else reversed(order):
            times[version][case].append(workers[version].ask(case)["ms"])
        print(f"repetition {repetition + 1}/{args.repeats}", file=sys.stderr, flush=True)
    for w in workers.values():
        w.close()
    counts_path.unlink()
    rows = []
    for case in cases:
        head, shape = case.split("@")
        now = times["now"][case]
        row: dict[str, Any] = {
            "case": case,
            "head": head,
            "shape": shape,
            "ms": statistics.median(now),
            "x_softmax": median_ratio(now, times["now"][f"softmax@{shape}"]),
            "memory": built[("now", case)]["memory"],
            "loss": built[("now", case)]["value"],
        }
        if "baseline" in versions:
            before = times["baseline"][case]
            row |= {
                "ms_baseline": statistics.median(before),
                "x_baseline": median_ratio(now, before),
                "x_softmax_baseline": median_ratio(before, times["baseline"][f"softmax@{shape}"]),
                "loss_baseline": built[("baseline", case)]["value"],
            }
        if "mos" in args.heads:
            row["x_mos"] = median_ratio(now, times["now"][f"mos@{shape}"])
        rows.append(row)
    return {
        "rows": rows,
        "times_ms": times,
        "commits": {name: commit_of(root) for name, root in versions.items()},
        "token_counts": source,
        "shared_gate_below": args.shared_gate_below,
        "frequent_words": int(np.sum(counts >= args.shared_gate_below)),
        "repeats": args.repeats,
    }


RATIOS = ("x_softmax", "x_baseline", "x_softmax_baseline", "x_mos")


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of :func:`run`, each with fresh workers: per case the median over the runs of each
    run's times and ratios, and each ratio's range over the runs (``KEY_range``)."""
    if len(runs) == 1:
        return {**runs[0], "runs": 1}
    rows = []
    for i, row in enumerate(runs[0]["rows"]):
        merged = dict(row)
        for key in ("ms", "ms_baseline", *RATIOS):
            if key in row:
                values = [run["rows"][i][key] for run in runs]
                merged[key] = statistics.median(values)
                if key in RATIOS:
                    merged[f"{key}_range"] = (min(values), max(values))
        rows.append(merged)
    return {
        **runs[0],
        "rows": rows,
        "times_ms": [run["times_ms"] for run in runs],
        "runs": len(runs),
    }


def _ratio(row: dict[str, Any], key: str) -> str:
    if key not in row:
        return "nan"
    low, high = row.get(f"{key}_range", (None, None))
    return f"{row[key]:.2f}" + ("" if low is None else f" ({low:.2f}–{high:.2f})")


def markdown(result: dict[str, Any]) -> str:
    commits = result["commits"]
    baseline = "baseline" in commits
    header = ["shape", "head", "ms", "x softmax", "x MoS", "memory / logits"]
    if baseline:
        header[3:3] = [f"ms at {commits['baseline']}", "x baseline"]
        header.append(f"x softmax at {commits['baseline']}")
    lines = [
        f"# Head loss cost, {commits['now']} against {commits.get('baseline', 'nothing')}",
        "",
        f"Forward + backward of `head.loss` (all gradients), median ms over {result['repeats']} "
        "interleaved repetitions; ratios are medians of per-repetition ratios in the same run"
        + (
            "."
            if result["runs"] == 1
            else f"; then the median over {result['runs']} such runs, each with fresh worker "
            "processes, and in brackets the runs' smallest and largest ratio."
        )
        + " "
        f"Mixtape shared: words seen < {result['shared_gate_below']:g} times share one gate "
        f"({result['frequent_words']} words with their own, counts: {result['token_counts']}). "
        "Memory: compiled temporaries over the full float32 logits.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in result["rows"]:
        cells = [row["shape"], row["head"], f"{row['ms']:.1f}"]
        if baseline:
            cells += [f"{row['ms_baseline']:.1f}", _ratio(row, "x_baseline")]
        cells += [_ratio(row, "x_softmax"), _ratio(row, "x_mos")]
        cells.append("-" if row["memory"] is None else f"{row['memory']:.3f}")
        if baseline:
            cells.append(_ratio(row, "x_softmax_baseline"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of the code to compare against")
    parser.add_argument("--data_dir", type=Path, help="PTB's folder (ptb.train.txt) for counts")
    parser.add_argument("--heads", default=",".join(HEADS), help="comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--runs", type=int, default=1, help="whole runs, fresh workers each")
    parser.add_argument("--shared-gate-below", type=float, default=100.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/head_cost.json"))
    args = parser.parse_args()
    args.heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for name in args.heads:
        if name not in HEADS:
            parser.error(f"unknown head {name!r}; choose from {', '.join(HEADS)}")
    for name in args.shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    if "softmax" not in args.heads:
        parser.error("--heads must include softmax, the reference of the ratios")
    if args.baseline is not None and not (args.baseline / "bottleneck").is_dir():
        parser.error(f"--baseline {args.baseline} has no bottleneck/ package")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    result = combine([run(args) for _ in range(args.runs)])
    text = markdown(result)
    # The workers ran the code; this process's bottleneck may be another checkout's.
    write_results(
        args.out, {**result, "machine": machine_info()}, text, commit=result["commits"]["now"]
    )
    print(text)


if __name__ == "__main__":
    main()
