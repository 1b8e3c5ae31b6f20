"""Speed and memory of every output head's chunked loss against a naive softmax cross-entropy.

For each head of :data:`bottleneck.nn.HEAD_NAMES` it times the jit-compiled forward+backward
pass of ``head.loss(h, labels)`` (the memory-bounded, chunked mean NLL), i.e.
``jax.value_and_grad(f, argnums=(0, 1))(state, h, labels)`` with
``f = lambda state, h, y: nnx.merge(graphdef, state).loss(h, y)``: gradients with respect to
every parameter of the head and the hidden states. The baseline is the textbook cross-entropy
of a plain softmax head written with ``jax.nn`` (own ``W``, ``b``; gradient w.r.t. ``W``, ``b``
and ``h``), timed interleaved with each head in the same process (``benchmarks/_timing.py``).

Two batch shapes, both with ``d = 400`` (Merity et al.'s AWD-LSTM sizes):

* PTB, ``N = 20 x 70 = 1400`` tokens, ``M = 10,000``: every head's median milliseconds and the
  median of per-repetition ratios head / naive softmax, against a target per head. For context
  it also times each head's *naive* loss, ``bn.cross_entropy(head(h), labels)`` by plain
  autodiff (full ``[N, M]`` logits, ``[N, K, M]`` for a mixture), in fewer repetitions, and
  checks that it agrees with the chunked loss.
* WikiText-2, ``N = 80 x 70 = 5600``, ``M = 33,278``: the compiled temporaries of the
  forward+backward pass (``compiled.memory_analysis().temp_size_in_bytes``, lowered on
  ``jax.ShapeDtypeStruct`` inputs so nothing big is allocated) as a fraction of the full
  float32 logits ``N x M x 4`` bytes (target: at most 1/4 for every head), for every head, its
  naive version and the naive softmax; and the time of softmax, sigsoftmax, PLIF and the naive
  softmax. MoS is timed there too only if the estimated time fits in ``--time-budget``.

Run from the repository root:

    python benchmarks/heads.py [--quick] [--heads softmax,mos] [--out benchmarks/results/heads.json]

``--quick`` times 2 repetitions at the PTB shape (1 for the naive heads and at the WT2 shape)
instead of 7 (2 for the naive heads, 3 at the WT2 shape); ``--memory-budget-mib`` overrides
every head's ``memory_budget``. The markdown tables are printed and saved next to the JSON
file, with the suffix ``.md``. The machine's load average is recorded before and after each part: the
per-repetition ratios are robust to a steady load, not to bursts.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _shapes import PTB, WT2, Shape
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
from bottleneck.losses import DEFAULT_MEMORY_BUDGET, chunk_size_for_budget

HEAD_OPTIONS: dict[str, dict[str, Any]] = {
    "plif": {"num_knots": 100_000, "plif_noise": 1.0},
    "monotone_mlp": {"num_hidden": 8},
    "mos": {"num_components": 15},
    "moss": {"num_components": 15},
    "mos_plif": {"num_components": 15, "num_knots": 100_000, "plif_noise": 1.0},
    # Yang et al. 2019's K = 4 (sigmoid tree); no gate sharing (random hidden states, no corpus).
    "mixtape": {"num_components": 4},
}
# Fastest allowed ratio head / naive softmax cross-entropy at the PTB shape (2-core CPU).
SPEED_TARGETS = {"softmax": 1.15, "sigsoftmax": 1.25, "plif": 1.35, "mos": 16.0}
MEMORY_TARGET = 0.25  # compiled temporaries / full float32 logits, at the WT2 shape
WT2_TIMED_HEADS = ("softmax", "sigsoftmax", "plif")
NAIVE_SOFTMAX = "naive softmax CE"
# The naive per-head loss is timed only when one [N, elements_per_token] float32 buffer is at
# most this big (its value_and_grad keeps a few of them): naive MoS-15 at the PTB shape is
# 0.8 GiB; at the WT2 shape it would be 10.4 GiB per buffer, so it is never timed there.
NAIVE_BUFFER_LIMIT = 2 * 2**30

Call = Callable[[], Any]


def loadavg() -> list[float]:
    return [round(load, 2) for load in os.getloadavg()]


def make_head(name: str, shape: Shape, memory_budget: int) -> nn.OutputHead:
    options = {**HEAD_OPTIONS.get(name, {}), "memory_budget": memory_budget}
    return nn.make_head(name, shape.dim, shape.vocab, rngs=nnx.Rngs(0), **options)


def inputs(shape: Shape, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Hidden states ``N(0, 1)`` ``[N, d]`` and uniform random labels ``[N]``."""
    hidden_key, labels_key = jax.random.split(key)
    h = jax.random.normal(hidden_key, (shape.tokens, shape.dim), jnp.float32)
    labels = jax.random.randint(labels_key, (shape.tokens,), 0, shape.vocab)
    return h, labels


def input_specs(shape: Shape) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return (
        jax.ShapeDtypeStruct((shape.tokens, shape.dim), jnp.float32),
        jax.ShapeDtypeStruct((shape.tokens,), jnp.int32),
    )


def head_loss_grad(head: nn.OutputHead, naive: bool = False) -> tuple[Callable, nnx.State]:
    """Jitted ``value_and_grad`` of the head's chunked loss (or its naive loss) and its state."""
    graphdef, state = nnx.split(head)

    def loss(state: nnx.State, h: jax.Array, labels: jax.Array) -> jax.Array:
        module = nnx.merge(graphdef, state)
        return bn.cross_entropy(module(h), labels) if naive else module.loss(h, labels)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), state


def naive_softmax_loss(
    params: tuple[jax.Array, jax.Array], h: jax.Array, labels: jax.Array
) -> jax.Array:
    """The textbook softmax cross-entropy: full logits, ``jax.nn.log_softmax``, one gather."""
    weight, bias = params
    log_probs = jax.nn.log_softmax(h @ weight.T + bias)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def naive_softmax(shape: Shape) -> tuple[Callable, tuple[jax.Array, jax.Array]]:
    """Jitted ``value_and_grad`` w.r.t. ``((W, b), h)`` and its parameters (init as the heads)."""
    weight = jax.random.uniform(
        jax.random.key(1), (shape.vocab, shape.dim), minval=-0.1, maxval=0.1
    )
    params = (weight, jnp.zeros((shape.vocab,), jnp.float32))
    return jax.jit(jax.value_and_grad(naive_softmax_loss, argnums=(0, 1))), params


def recorded(fn: Call, outputs: dict[str, Any], name: str) -> Call:
    """``fn`` that also keeps its latest output in ``outputs[name]`` (to compare versions)."""

    def call() -> Any:
        outputs[name] = fn()
        return outputs[name]

    return call


def relative_differences(a: Any, b: Any) -> dict[str, float]:
    """``max|a - b| / max|b|`` of the loss and of each gradient leaf, keyed by its path.

    The denominator is floored at 1e-6 of the largest gradient: a gradient that is zero in
    exact arithmetic (the monotone MLP's output bias, which softmax's shift invariance cancels)
    holds only float32 round-off, which would otherwise read as an O(1) relative difference.
    """
    leaves = jax.tree_util.tree_leaves_with_path(b)
    floor = 1e-6 * max(float(jnp.max(jnp.abs(y))) for _, y in leaves)
    return {
        jax.tree_util.keystr(path): float(jnp.max(jnp.abs(x - y)))
        / max(float(jnp.max(jnp.abs(y))), floor)
        for (path, y), x in zip(leaves, jax.tree.leaves(a), strict=True)
    }


def ratio_summary(times: dict[str, list[float]], name: str, baseline: str) -> dict[str, Any]:
    median_ms = medians(times)
    return {
        "median_ms": median_ms[name],
        "naive_softmax_ms": median_ms[baseline],
        "ratio": median_ratio(times[name], times[baseline]),
        "times_ms": [round(t, 2) for t in times[name]],
        "naive_softmax_times_ms": [round(t, 2) for t in times[baseline]],
    }


def bench_ptb(
    names: list[str],
    memory_budget: int,
    repeats: int,
    naive_repeats: int,
    progress: tqdm,
) -> dict[str, dict[str, Any]]:
    """Chunked loss of each head vs the naive softmax CE, then each head's naive loss."""
    h, labels = inputs(PTB, jax.random.key(2))  # not the parameters' seed (0)
    baseline, baseline_params = naive_softmax(PTB)
    baseline_call = functools.partial(baseline, baseline_params, h, labels)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        progress.set_postfix_str(f"ptb {name}")
        head = make_head(name, PTB, memory_budget)
        chunk = chunk_size_for_budget(
            PTB.tokens, head.elements_per_token, memory_budget, head.buffers_per_element
        )
        outputs: dict[str, Any] = {}
        loss_grad, state = head_loss_grad(head)
        calls = {
            name: recorded(functools.partial(loss_grad, state, h, labels), outputs, "chunked"),
            NAIVE_SOFTMAX: baseline_call,
        }
        load_before = loadavg()
        times = time_interleaved(calls, repeats, on_call=progress.update)
        result = ratio_summary(times, name, NAIVE_SOFTMAX)
        target = SPEED_TARGETS.get(name)
        result.update(
            options=HEAD_OPTIONS.get(name, {}),
            elements_per_token=head.elements_per_token,
            chunk_tokens=chunk,
            num_chunks=-(-PTB.tokens // chunk),
            target=target,
            met=None if target is None else result["ratio"] <= target,
            loadavg_before=load_before,
        )

        naive_bytes = PTB.tokens * head.elements_per_token * 4
        if naive_bytes <= NAIVE_BUFFER_LIMIT and naive_repeats > 0:
            naive_loss_grad, _ = head_loss_grad(head, naive=True)
            naive_calls = {
                "naive head": recorded(
                    functools.partial(naive_loss_grad, state, h, labels), outputs, "naive"
                ),
                NAIVE_SOFTMAX: baseline_call,
            }
            naive_times = time_interleaved(naive_calls, naive_repeats, on_call=progress.update)
            naive = ratio_summary(naive_times, "naive head", NAIVE_SOFTMAX)
            differences = relative_differences(outputs["chunked"], outputs["naive"])
            result["naive_head"] = {
                "median_ms": naive["median_ms"],
                "ratio": naive["ratio"],
                "times_ms": naive["times_ms"],
                "relative_differences_vs_chunked": differences,
                "max_relative_difference_vs_chunked": max(differences.values()),
                "worst_leaf": max(differences, key=differences.__getitem__),
            }
        else:
            result["naive_head"] = {
                "skipped": f"one [N, {head.elements_per_token}] float32 buffer is "
                f"{naive_bytes / 2**30:.1f} GiB"
            }
        result["loadavg_after"] = loadavg()
        results[name] = result
        del outputs, calls
    return results


def compiled_temp_bytes(loss_grad: Callable, *args: Any) -> tuple[Any, int]:
    compiled = loss_grad.lower(*args).compile()
    return compiled, int(compiled.memory_analysis().temp_size_in_bytes)


def bench_wt2_memory(
    names: list[str], memory_budget: int, progress: tqdm
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Compiled temporaries of every head's loss (and naive loss) at the WT2 shape.

    Returns the table and the compiled executables of the chunked losses and the naive softmax
    (reused for timing), keyed by head name and :data:`NAIVE_SOFTMAX`, with their states.
    """
    h_spec, labels_spec = input_specs(WT2)
    full = WT2.full_logits_bytes
    table: dict[str, dict[str, Any]] = {}
    executables: dict[str, Any] = {}
    for name in names:
        progress.set_postfix_str(f"wt2 memory {name}")
        head = make_head(name, WT2, memory_budget)
        loss_grad, state = head_loss_grad(head)
        compiled, temp = compiled_temp_bytes(loss_grad, state, h_spec, labels_spec)
        executables[name] = (compiled, state)
        naive_loss_grad, _ = head_loss_grad(head, naive=True)
        _, naive_temp = compiled_temp_bytes(naive_loss_grad, state, h_spec, labels_spec)
        chunk = chunk_size_for_budget(
            WT2.tokens, head.elements_per_token, memory_budget, head.buffers_per_element
        )
        table[name] = {
            "temp_bytes": temp,
            "fraction_of_full_logits": temp / full,
            "target": MEMORY_TARGET,
            "met": temp / full <= MEMORY_TARGET,
            "chunk_tokens": chunk,
            "num_chunks": -(-WT2.tokens // chunk),
            "naive_head_temp_bytes": naive_temp,
            "naive_head_fraction_of_full_logits": naive_temp / full,
        }
        progress.update(1)
    progress.set_postfix_str("wt2 memory naive softmax")
    baseline, params = naive_softmax(WT2)
    compiled, temp = compiled_temp_bytes(baseline, params, h_spec, labels_spec)
    executables[NAIVE_SOFTMAX] = (compiled, params)
    table[NAIVE_SOFTMAX] = {"temp_bytes": temp, "fraction_of_full_logits": temp / full}
    progress.update(1)
    return table, executables


def bench_wt2_speed(
    names: list[str],
    executables: dict[str, Any],
    repeats: int,
    warmup: int,
    progress: tqdm,
) -> dict[str, dict[str, Any]]:
    """Each head interleaved with the naive softmax, with the executables compiled already."""
    h, labels = inputs(WT2, jax.random.key(2))
    compiled, params = executables[NAIVE_SOFTMAX]
    baseline_call = functools.partial(compiled, params, h, labels)
    results = {}
    for name in names:
        progress.set_postfix_str(f"wt2 speed {name}")
        compiled, state = executables[name]
        calls = {name: functools.partial(compiled, state, h, labels), NAIVE_SOFTMAX: baseline_call}
        load_before = loadavg()
        times = time_interleaved(calls, repeats, warmup=warmup, on_call=progress.update)
        results[name] = {
            **ratio_summary(times, name, NAIVE_SOFTMAX),
            "repeats": repeats,
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
        }
    return results


def speed_table(results: dict[str, dict[str, Any]]) -> str:
    header = [
        "head",
        "chunk (tokens x chunks)",
        "loss fwd+bwd ms",
        "naive softmax CE ms",
        "ratio",
        "target",
        "met",
        "naive head ms",
        "naive head ratio",
        "naive vs chunked max rel. diff",
    ]
    rows = []
    for name, r in results.items():
        naive = r["naive_head"]
        rows.append(
            [
                name,
                f"{r['chunk_tokens']} x {r['num_chunks']}",
                r["median_ms"],
                r["naive_softmax_ms"],
                f"{r['ratio']:.2f}",
                "-" if r["target"] is None else f"<= {r['target']:g}",
                "-" if r["met"] is None else ("yes" if r["met"] else "**no**"),
                naive.get("median_ms", "skipped"),
                f"{naive['ratio']:.2f}" if "ratio" in naive else "-",
                f"{naive['max_relative_difference_vs_chunked']:.1e}" if "ratio" in naive else "-",
            ]
        )
    return markdown_table(header, rows)


def memory_table(memory: dict[str, dict[str, Any]], speed: dict[str, dict[str, Any]]) -> str:
    header = [
        "head",
        "chunk (tokens x chunks)",
        "temp MiB",
        "/ full logits",
        "met (<= 1/4)",
        "naive head temp MiB",
        "naive / full logits",
        "loss fwd+bwd ms",
        "naive softmax CE ms",
        "ratio",
    ]
    rows = []
    for name, m in memory.items():
        s = speed.get(name)
        is_head = name != NAIVE_SOFTMAX
        rows.append(
            [
                name,
                f"{m['chunk_tokens']} x {m['num_chunks']}" if is_head else "-",
                m["temp_bytes"] / 2**20,
                f"{m['fraction_of_full_logits']:.3f}",
                ("yes" if m["met"] else "**no**") if is_head else "-",
                m["naive_head_temp_bytes"] / 2**20 if is_head else "-",
                f"{m['naive_head_fraction_of_full_logits']:.2f}" if is_head else "-",
                s["median_ms"] if s else "-",
                s["naive_softmax_ms"] if s else "-",
                f"{s['ratio']:.2f}" if s else "-",
            ]
        )
    return markdown_table(header, rows)


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 PTB repetitions instead of 7")
    parser.add_argument("--heads", default=",".join(nn.HEAD_NAMES), help="comma-separated")
    parser.add_argument(
        "--memory-budget-mib",
        type=float,
        default=DEFAULT_MEMORY_BUDGET / 2**20,
        help="memory_budget of every head, MiB (default: the library default)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=900.0,
        help="seconds; MoS is timed at the WT2 shape only if its estimate fits",
    )
    parser.add_argument("--skip-wt2", action="store_true", help="PTB timings only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/heads.json"))
    args = parser.parse_args()
    names = [name.strip() for name in args.heads.split(",") if name.strip()]
    unknown = sorted(set(names) - set(nn.HEAD_NAMES))
    if unknown:
        parser.error(f"unknown heads {unknown}; choose from {', '.join(nn.HEAD_NAMES)}")
    memory_budget = int(args.memory_budget_mib * 2**20)
    repeats, naive_repeats, wt2_repeats = (2, 1, 1) if args.quick else (7, 2, 3)
    wt2_speed_names = [name for name in WT2_TIMED_HEADS if name in names]
    load_start = loadavg()

    ptb_calls = len(names) * (2 * (repeats + 1) + 2 * (naive_repeats + 1))
    wt2_calls = (
        0 if args.skip_wt2 else len(names) + 1 + len(wt2_speed_names) * 2 * (wt2_repeats + 1)
    )
    progress = tqdm(total=ptb_calls + wt2_calls, desc="heads", unit="call")
    ptb = bench_ptb(names, memory_budget, repeats, naive_repeats, progress)
    load_after_ptb = loadavg()

    wt2_memory: dict[str, dict[str, Any]] = {}
    wt2_speed: dict[str, dict[str, Any]] = {}
    mos_wt2_note = "not selected" if "mos" not in names else None
    if not args.skip_wt2:
        wt2_memory, executables = bench_wt2_memory(names, memory_budget, progress)
        wt2_speed = bench_wt2_speed(wt2_speed_names, executables, wt2_repeats, 1, progress)
        if "mos" in names:
            # MoS work scales with N x M like the softmax's: 2 timed calls, no warm-up (the
            # executable is compiled), plus 2 naive softmax calls.
            scale = (WT2.tokens * WT2.vocab) / (PTB.tokens * PTB.vocab)
            estimate = 2e-3 * scale * (ptb["mos"]["median_ms"] + ptb["mos"]["naive_softmax_ms"])
            elapsed = time.perf_counter() - start
            if elapsed + estimate <= args.time_budget:
                progress.total += 4
                wt2_speed.update(bench_wt2_speed(["mos"], executables, 2, 0, progress))
                mos_wt2_note = f"timed (estimate {estimate:.0f} s fitted the time budget)"
            else:
                mos_wt2_note = (
                    f"skipped: estimated {estimate:.0f} s (PTB time x {scale:.1f}) after "
                    f"{elapsed:.0f} s would exceed the {args.time_budget:.0f} s time budget"
                )
        del executables
    progress.close()
    runtime = time.perf_counter() - start

    ptb_heading = (
        f"## PTB batch: N = {PTB.batch} x {PTB.steps} = {PTB.tokens} tokens, d = {PTB.dim}, "
        f"M = {PTB.vocab:,}\n\nForward+backward of `head.loss` (value_and_grad w.r.t. all "
        f"parameters and h), median of {repeats} interleaved repetitions; ratio = median of "
        f"per-repetition ratios head / naive softmax CE. Naive head = "
        f"`bn.cross_entropy(head(h), y)` by plain autodiff, {naive_repeats} repetition(s).\n\n"
    )
    text = "# Output heads: chunked loss speed and memory\n\n" + ptb_heading + speed_table(ptb)
    text += (
        "\nMax rel. diff: largest `max|chunked - naive| / max|naive|` over the loss and the "
        "gradient leaves (JSON: per leaf). PLIF is discontinuous in its slope at the knots: "
        "with noisy slopes, float32 round-off that differs between the two computations of "
        "the logits moves some across a knot, which changes their gradient by O(1); 1e5 knots "
        "and a 15-component mixture make that visible for mos_plif (~1e-2; ~1e-6 with equal "
        "slopes or in float64).\n"
    )
    if not args.skip_wt2:
        text += (
            f"\n## WikiText-2 batch: N = {WT2.batch} x {WT2.steps} = {WT2.tokens} tokens, "
            f"d = {WT2.dim}, M = {WT2.vocab:,}\n\nCompiled temporaries of the forward+backward "
            f"pass (`memory_analysis().temp_size_in_bytes`) / full float32 logits "
            f"({WT2.full_logits_bytes / 2**20:.0f} MiB); times: median of {wt2_repeats} "
            f"interleaved repetitions. MoS-15 timing: {mos_wt2_note}.\n\n"
        ) + memory_table(wt2_memory, wt2_speed)
    text += (
        f"\nMemory budget {args.memory_budget_mib:g} MiB per chunk. Load average (1, 5, 15 min): "
        f"{load_start} before, {loadavg()} after; {os.cpu_count()} CPUs. "
        f"Total runtime {runtime:.0f} s.\n"
    )
    print(text, end="")
    write_results(
        args.out,
        {
            "benchmark": "heads",
            "machine": machine_info(),
            "loadavg_before": load_start,
            "loadavg_after_ptb": load_after_ptb,
            "loadavg_after": loadavg(),
            "runtime_s": runtime,
            "command": "python benchmarks/heads.py"
            + (" --quick" if args.quick else "")
            + ("" if names == list(nn.HEAD_NAMES) else f" --heads {','.join(names)}"),
            "dtype": "float32",
            "memory_budget_bytes": memory_budget,
            "loss": "value_and_grad(head.loss, argnums=(state, h)); labels uniform, h ~ N(0, 1)",
            "baseline": "value_and_grad of -mean(take_along_axis(jax.nn.log_softmax(h @ W.T + b)"
            ", y)) w.r.t. (W, b, h)",
            "ratio": "median over repetitions of head_ms / naive_softmax_ms (interleaved)",
            "ptb": {
                "shape": {**asdict(PTB), "tokens": PTB.tokens},
                "repeats": repeats,
                "naive_head_repeats": naive_repeats,
                "speed_targets": SPEED_TARGETS,
                "results": ptb,
            },
            "wt2": {
                "shape": {**asdict(WT2), "tokens": WT2.tokens},
                "full_logits_bytes": WT2.full_logits_bytes,
                "memory_target_fraction": MEMORY_TARGET,
                "memory": wt2_memory,
                "repeats": wt2_repeats,
                "speed": wt2_speed,
                "mos_speed": mos_wt2_note,
            }
            if not args.skip_wt2
            else "skipped",
        },
        text,
    )


if __name__ == "__main__":
    main()
