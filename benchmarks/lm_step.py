"""Seconds per AWD-LSTM training step with each output head, as ratios to softmax.

One full training step of ``bottleneck.train.Trainer.window_step`` (dropout masks, forward,
the head's chunked loss + AR/TAR, backward, global-norm clipping, SGD with weight decay) at the
paper's PTB shapes: batch 20, bptt 70, vocabulary 10,000, emsize 400, nhid 1150, 3 layers,
tied embeddings, for the heads

* ``softmax``, ``sigsoftmax`` and ``plif`` (10^5 knots, its own learning rate) on that model;
* ``mos``: Yang et al.'s MoS with its own PTB sizes (emsize 280, nhid 960, nhidlast 620,
  K = 15, latent dropout 0.29) at the same batch and bptt, so the same tokens per step: the
  comparison behind the seeds' "MoS ~150 s vs ~60 s per PTB epoch" (2.5x);
* ``mos_awd``: K = 15 components on the AWD-LSTM model itself (latents of 400), for reference;
* ``mixtape`` (Yang et al. 2019: K = 4, sigmoid-tree gates, one softmax over gated logits) and
  ``mos_k4`` (MoS at the same K = 4), both on MoS's PTB sizes: Mixtape's cost against softmax
  and against MoS at the same K, without gate sharing;
* ``mixtape_shared``: the same Mixtape with gate sharing (words seen fewer than 100 times in
  training share one gate; the counts are PTB's with ``--data_dir``, else a Zipf law);
* ``softmax_mos``: softmax on the model nearest MoS's sizes (280/960, its last layer 280 wide
  for the tied decoder): the heads on MoS's sizes are also given as ratios to it
  (``to softmax_mos``), their own cost without the trunk's difference, and Mixtape with sharing
  meets its target against it where it is timed.

All candidates are timed interleaved in one process (``benchmarks/_timing.py``); the ratio of a
head is the median over repetitions of its step time over softmax's in the same repetition.
Targets (Ganea et al.'s slides: PLIF +17% per epoch, MoS 2.5x; Yang et al. 2019: Mixtape
1.2-1.34x): PLIF <= 1.10x, MoS <= 2.5x, Mixtape with sharing <= 1.2x.

``--model transformer`` times another comparison instead: the softmax step of
``language_model.py transformer-cpu`` (vocabulary 2,000, width 128, 4 layers, RoPE,
RMSNorm, AdamW, batch 32 x 64) against the same step in PyTorch
(``benchmarks/_torch_transformer.py``) at each ``--torch-threads``, written to
``benchmarks/results/transformer_step.json`` by default. Stop other jobs first: a PyTorch run
whose OpenMP threads share busy cores spins (20x slower with 2 threads beside a 2-thread job).

Timed in the same interleaved repetitions, for the softmax step (issue 13):

* ``floor``: the step's own matmuls alone (the same GEMM shapes and operand layouts, forward and
  backward: LSTM input projections, the 70 recurrent products per layer each way, dW / dx, the
  tied decoder) as one jitted function; ``step / floor`` is how far the step is from them;
* ``softmax_before``: the same step as it was when issue 13 was filed: the previous ``lstm``
  (below, differentiated by autodiff through ``jax.lax.scan``) and the dropout masks drawn by
  one ``jax.random.uniform`` (the same masks, unblocked): the before/after comparison;
* ``torch_<n>t``: a PyTorch AWD-LSTM step (``benchmarks/_torch_awd_lstm.py``) when ``torch``
  is installed (``pip install -e ".[bench]"``), once per thread count ``n`` in
  ``--torch-threads`` (default ``1,2``: the issue's single-threaded reference, and the two
  threads XLA:CPU uses on a 2-core machine), each call under ``torch.set_num_threads(n)``.

For one core each, pin the whole process: ``taskset -c 0 python benchmarks/lm_step.py --heads
softmax --torch-threads 1``. Timings of a loaded machine are not comparable across libraries:
XLA's two threads lose a core to other jobs before a one-thread PyTorch does.

Run from the repository root (``--repeats 5``: about 1.5 minutes on 2 Zen 5 cores):

    python benchmarks/lm_step.py [--quick | --repeats N] [--heads softmax,plif] [--torch-threads 1,2]
        [--data_dir PTB_DIR] [--model transformer] [--out benchmarks/results/lm_step.json]

``--quick`` times 3 repetitions instead of 10. The markdown table is printed and saved next to
the JSON file with the suffix ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _shapes import random_window, token_counts
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

import bottleneck._blockwise_random as blockwise_random
import bottleneck.nn.awd_lstm as awd_lstm
from bottleneck.data import BpttWindow
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel, LSTMState
from bottleneck.train import Trainer, make_optimizer
from bottleneck.train.lm import pad_window

VOCAB, BATCH, BPTT = 10_000, 20, 70
AWD = {"emsize": 400, "nhid": 1150, "nlayers": 3, "dropout": 0.4, "dropouth": 0.25,
       "dropouti": 0.4, "dropoute": 0.1, "wdrop": 0.5}  # fmt: skip
MOS_PTB = {**AWD, "emsize": 280, "nhid": 960, "nhidlast": 620, "dropouth": 0.225,
           "dropoutl": 0.29}  # fmt: skip
CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = {
    "softmax": ("softmax", AWD),
    "sigsoftmax": ("sigsoftmax", AWD),
    "plif": ("plif", {**AWD, "num_knots": 100_000}),
    "mos": ("mos", {**MOS_PTB, "num_components": 15}),
    "mos_awd": ("mos", {**AWD, "num_components": 15}),
    "mixtape": ("mixtape", {**MOS_PTB, "num_components": 4}),
    # + token_counts (PTB's with --data_dir, else a Zipf law): Yang et al. 2019's gate sharing
    "mixtape_shared": ("mixtape", {**MOS_PTB, "num_components": 4, "shared_gate_below": 100.0}),
    "mos_k4": ("mos", {**MOS_PTB, "num_components": 4}),
    # softmax's model nearest MoS's sizes (a tied softmax decodes the last layer: 280 wide)
    "softmax_mos": (
        "softmax",
        {**{k: v for k, v in MOS_PTB.items() if k != "dropoutl"}, "nhidlast": 280},
    ),  # fmt: skip
}
# The heads on MoS's sizes, whose ratio to softmax_mos (where timed) is the head's own cost.
MOS_SIZED = ("mos", "mixtape", "mixtape_shared", "mos_k4", "softmax_mos")
TARGETS = {"plif": 1.10, "mos": 2.5, "mixtape_shared": 1.2}


def lstm_scan_autodiff(
    w_ih: jax.Array,
    w_hh: jax.Array,
    bias: jax.Array,
    inputs: jax.Array,
    state: LSTMState,
    length: jax.Array | int | None = None,
    unroll: int = 1,
) -> tuple[jax.Array, LSTMState]:
    """The baseline ("before"): ``bottleneck.nn.awd_lstm.lstm`` as it was before its custom VJP
    (commit a7b1767), differentiated by autodiff through the scan, which accumulates dW_hh with
    one small product per step inside the reverse loop."""
    input_gates = jnp.einsum("tbi,gi->tbg", inputs, w_ih) + bias
    steps = jnp.arange(inputs.shape[0], dtype=jnp.int32)

    def step(carry: LSTMState, xs: tuple[jax.Array, jax.Array]) -> tuple[LSTMState, jax.Array]:
        gates_x, t = xs
        gates = gates_x + carry.h @ w_hh.T
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * carry.c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        if length is not None:
            real = t < length
            h, c = jnp.where(real, h, carry.h), jnp.where(real, c, carry.c)
        return LSTMState(h, c), h

    final, outputs = jax.lax.scan(step, state, (input_gates, steps), unroll=unroll)
    return outputs, final


def uniform_in_one_draw(key: jax.Array, num: int) -> jax.Array:
    """The baseline's dropout draw: ``jax.random.uniform`` of all masks at once (the same
    numbers as ``bottleneck._blockwise_random.uniform``, drawn without blocks)."""
    return jax.random.uniform(key, (num,), jnp.float32)


@contextlib.contextmanager
def baseline_step() -> Iterator[None]:
    """Traces the model as it was when issue 13 was filed: :func:`lstm_scan_autodiff` and
    :func:`uniform_in_one_draw` (``LSTMLayer`` and ``inverted_dropout_masks`` look them up when
    traced; a compiled step keeps what it was traced with)."""
    new = awd_lstm.lstm, blockwise_random.uniform
    awd_lstm.lstm, blockwise_random.uniform = lstm_scan_autodiff, uniform_in_one_draw
    try:
        yield
    finally:
        awd_lstm.lstm, blockwise_random.uniform = new


def floor_call(options: dict[str, Any]) -> Callable[[], Any]:
    """The softmax step's matmuls alone, forward and backward, as one jitted function.

    The same GEMM shapes and operand layouts as the step: per layer the input projection, the
    T recurrent products ``h W_hh^T`` (a loop, as they depend on each other), the T products
    ``dgates W_hh`` of the backward loop, ``dW_hh``,
    ``dW_ih`` and ``dx`` over all steps; the tied decoder's logits, ``dh`` and ``dE``. Only a
    slice and an add join them, so its time is what the step would take with free elementwise
    work, free randomness and a free optimizer.
    """
    sizes = [options["emsize"]] + [options["nhid"]] * (options["nlayers"] - 1)
    sizes.append(options["emsize"])
    keys = iter(jax.random.split(jax.random.key(0), 4 * len(sizes)))

    def uniform(shape: tuple[int, ...], scale: float) -> jax.Array:
        return jax.random.uniform(next(keys), shape, jnp.float32, -scale, scale)

    layers = [
        (uniform((4 * h, i), h**-0.5), uniform((4 * h, h), h**-0.5))
        for i, h in zip(sizes[:-1], sizes[1:], strict=True)
    ]
    table = uniform((VOCAB, options["emsize"]), 0.1)
    x = uniform((BPTT, BATCH, options["emsize"]), 1.0)
    d_logits = uniform((BPTT * BATCH, VOCAB), 1e-4)

    def matmuls(layers: Any, table: jax.Array, x: jax.Array, d_logits: jax.Array) -> Any:
        results = []
        for w_ih, w_hh in layers:
            hidden = w_hh.shape[1]
            gates = jnp.einsum("tbi,gi->tbg", x, w_ih)

            def forward(h: jax.Array, g: jax.Array, w_hh: jax.Array = w_hh) -> Any:
                h = (g + h @ w_hh.T)[:, : h.shape[1]]
                return h, h

            _, hs = jax.lax.scan(forward, jnp.zeros((BATCH, hidden)), gates)

            def backward(dh: jax.Array, g: jax.Array, w_hh: jax.Array = w_hh) -> Any:
                return dh + g @ w_hh, None

            dh, _ = jax.lax.scan(backward, jnp.zeros((BATCH, hidden)), gates, reverse=True)
            results += [
                dh,
                jnp.einsum("tbg,tbh->gh", gates, hs),
                jnp.einsum("tbg,tbi->gi", gates, x),
                jnp.einsum("tbg,gi->tbi", gates, w_ih),
            ]
            x = hs
        flat = x.reshape(BPTT * BATCH, -1)
        results += [flat @ table.T, d_logits @ table, d_logits.T @ flat]
        return results

    compiled = jax.jit(matmuls)
    return lambda: compiled(layers, table, x, d_logits)


def step_call(name: str, window: Any, counts: np.ndarray | None = None) -> Callable[[], Any]:
    """A zero-argument call running one training step of candidate ``name`` (``counts``: the
    training counts of gate sharing)."""
    head, options = CANDIDATES[name]
    if "shared_gate_below" in options:
        options = {**options, "token_counts": counts}
    model = AWDLSTM(VOCAB, head=head, rngs=nnx.Rngs(0), **options)
    tx = make_optimizer(
        30.0,
        optimizer="sgd",
        plif_learning_rate=0.02 if head == "plif" else None,
        grad_clip_norm=0.25,
        weight_decay=1.2e-6,
    )
    trainer = Trainer(AWDLSTMLanguageModel(model, alpha=2.0, beta=1.0), tx)
    carry = trainer.initial_carry(BATCH)

    def call() -> Any:
        # The metrics come out of the same compiled step as the new state: waiting on them
        # waits for the whole step. The carry is not fed back, so every step does equal work.
        return trainer.window_step(carry, window, 1.0, averaging=False)[1]

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions instead of 10")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions")
    parser.add_argument(
        "--heads",
        default=",".join(CANDIDATES),
        help="comma-separated subset of " + ", ".join(CANDIDATES),
    )
    parser.add_argument(
        "--torch-threads",
        default="1,2",
        help="comma-separated torch.set_num_threads values: one PyTorch reference per value",
    )
    parser.add_argument(
        "--data_dir", type=Path, help="PTB's folder: mixtape_shared's counts (else a Zipf law)"
    )
    parser.add_argument(
        "--model", choices=("awd_lstm", "transformer"), default="awd_lstm",
        help="transformer: the transformer-cpu softmax step against its PyTorch peer instead",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/")
    args = parser.parse_args()
    if args.model == "transformer":
        transformer_main(args, parser)
        return
    args.out = args.out or Path("benchmarks/results/lm_step.json")
    names = [name.strip() for name in args.heads.split(",") if name.strip()]
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        parser.error(f"unknown head(s) {unknown}; choose from {', '.join(CANDIDATES)}")
    if "softmax" not in names:
        names.insert(0, "softmax")  # the reference of every ratio
    repeats = args.repeats or (3 if args.quick else 10)
    torch_threads = parse_torch_threads(args, parser)

    ids = np.random.default_rng(0).integers(0, VOCAB, (BPTT + 1, BATCH)).astype(np.int32)
    window = pad_window(BpttWindow(ids[:-1], ids[1:], BPTT, 1.0), BPTT)
    counts, counts_source = token_counts(args.data_dir, VOCAB)
    calls = {name: step_call(name, window, counts) for name in names}
    baseline = step_call("softmax", window)

    def before() -> Any:
        with baseline_step():
            return baseline()

    calls["softmax_before"] = before
    calls["floor"] = floor_call(AWD)
    torch_note = "not installed (pip install -e '.[bench]')"
    torch_names = {}
    try:
        import torch
        from _torch_awd_lstm import torch_step_call
    except ImportError:
        pass
    else:
        torch_note = f"torch {torch.__version__}"
        torch_step = torch_step_call(ids[:-1], ids[1:], vocab_size=VOCAB, **AWD)
        for threads in torch_threads:

            def call(threads: int = threads) -> float:
                torch.set_num_threads(threads)
                return torch_step()

            torch_names[f"torch_{threads}t"] = threads
            calls[f"torch_{threads}t"] = call
    progress = tqdm(total=len(calls) * (repeats + 1), desc="timing", unit="step")
    load_before = os.getloadavg()
    times = time_interleaved(calls, repeats, on_call=progress.update)
    load_after = os.getloadavg()
    progress.close()

    median_ms = medians(times)
    results = {
        name: {
            "head": CANDIDATES[name][0],
            "model": {k: v for k, v in CANDIDATES[name][1].items() if not k.startswith("drop")},
            "step_ms": median_ms[name],
            "ratio_to_softmax": median_ratio(times[name], times["softmax"]),
            "target_ratio": TARGETS.get(name),
            "times_ms": times[name],
        }
        for name in names
    }
    for name, result in results.items():
        if name in MOS_SIZED and "softmax_mos" in times:
            result["ratio_to_softmax_mos"] = median_ratio(times[name], times["softmax_mos"])
        # A head on MoS's sizes meets its target against softmax on those sizes where timed.
        ratio = result.get("ratio_to_softmax_mos", result["ratio_to_softmax"])
        target = result["target_ratio"]
        result["meets_target"] = None if target is None else ratio <= target
    header = ["head", "model", "step ms", "ratio to softmax", "to softmax_mos", "target"]
    rows = [
        [
            name,
            _model_label(name),
            result["step_ms"],
            f"{result['ratio_to_softmax']:.2f}",
            f"{result['ratio_to_softmax_mos']:.2f}" if "ratio_to_softmax_mos" in result else "",
            "" if result["target_ratio"] is None else
            f"<= {result['target_ratio']:.2f} ({'met' if result['meets_target'] else 'missed'})",
        ]
        for name, result in results.items()
    ]  # fmt: skip
    softmax = times["softmax"]
    comparisons = {
        "softmax_before": (
            "softmax step before: LSTM by autodiff through the scan, masks in one draw",
            median_ratio(times["softmax_before"], softmax),
        ),
        "floor": ("the softmax step's matmuls alone", median_ratio(times["floor"], softmax)),
    }
    for name, threads in torch_names.items():
        comparisons[name] = (
            f"PyTorch AWD-LSTM step ({torch_note}, torch.set_num_threads({threads}))",
            median_ratio(times[name], softmax),
        )
    table = markdown_table(header, rows)
    table += "\n" + markdown_table(
        ["vs", "what", "ms", "softmax step / it", "it / softmax step"],
        [
            [name, what, median_ms[name], f"{1.0 / ratio:.2f}", f"{ratio:.2f}"]
            for name, (what, ratio) in comparisons.items()
        ],
    )
    load = f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min)"
    cores = len(os.sched_getaffinity(0))
    table += f"\n{os.cpu_count()} CPUs ({cores} usable by this process), {load}\n"
    print(table, end="")
    write_results(
        args.out,
        {
            "benchmark": "lm_step",
            "machine": machine_info(),
            "load_average_before": load_before,
            "load_average_after": load_after,
            "vocab_size": VOCAB,
            "batch_size": BATCH,
            "bptt": BPTT,
            "repeats": repeats,
            "step": "one Trainer.window_step: masks, forward, chunked head loss + "
            "AR/TAR, backward, clip 0.25, SGD lr 30 + weight decay 1.2e-6",
            "ratio": "median over repetitions of step_ms / softmax step_ms (same repetition)",
            "results": results,
            "softmax_step_vs": {
                name: {
                    "what": what,
                    "step_ms": median_ms[name],
                    "it_over_softmax_step": ratio,
                    "times_ms": times[name],
                }
                for name, (what, ratio) in comparisons.items()
            },
            "torch": torch_note,
            "cores_usable": len(os.sched_getaffinity(0)),
            "mixtape_shared_counts": counts_source,
        },
        table,
    )


def parse_torch_threads(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[int]:
    """``--torch-threads`` as thread counts (a usage error unless positive integers)."""
    try:
        threads = [int(n) for n in args.torch_threads.split(",") if n.strip()]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        parser.error(f"--torch-threads takes positive integers, got {args.torch_threads!r}")
    return threads


def _model_label(name: str) -> str:
    head, options = CANDIDATES[name]
    if name not in MOS_SIZED:
        return "AWD-LSTM 400/1150" + (f", K={options['num_components']}" if head == "mos" else "")
    sizes = f"{options['emsize']}/{options['nhid']}/{options['nhidlast']}"
    k = f", K={options['num_components']}" if "num_components" in options else ""
    return f"MoS PTB sizes ({sizes}){k}" + (
        ", shared @100" if "shared_gate_below" in options else ""
    )


def transformer_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--model transformer``: the transformer-cpu preset's softmax step (``language_model.py
    transformer-cpu``: vocabulary 2,000, width 128, 4 layers, RoPE, RMSNorm, AdamW,
    batch 32 x 64) against the same step in PyTorch at each ``--torch-threads``."""
    from bottleneck.runs import language_model

    try:
        import torch
        from _torch_transformer import torch_transformer_step_call
    except ImportError:
        parser.error("--model transformer compares with PyTorch: pip install -e '.[bench]'")
    threads = parse_torch_threads(args, parser)
    config = language_model.PRESETS["transformer-cpu"]
    model, data, optimizer = config.model, config.data, config.optimizer
    vocab = data.vocab_size
    window = random_window(vocab, data.batch_size, data.bptt)
    trainer = Trainer(
        language_model.build_model(config, vocab),
        optimizer.transformation(plif=False, total_steps=10_000),
        seed=0,
    )
    calls: dict[str, Callable[[], Any]] = {
        "ours": lambda: trainer.window_step(None, window, 1.0, averaging=False)[1]
    }
    peer = torch_transformer_step_call(
        window.inputs, window.targets, vocab_size=vocab, d_model=model.d_model, num_heads=model.num_heads,
        d_ff=model.d_ff, num_layers=model.num_layers, dropout=model.residual_dropout,
        lr=optimizer.lr, weight_decay=optimizer.weight_decay, clip=optimizer.clip,
    )  # fmt: skip
    for n in threads:

        def call(n: int = n) -> float:
            torch.set_num_threads(n)
            return peer()

        calls[f"torch_{n}t"] = call
    repeats = args.repeats or (3 if args.quick else 10)
    load_before = os.getloadavg()
    with tqdm(total=len(calls) * (repeats + 1), desc="timing", unit="step") as progress:
        times = time_interleaved(calls, repeats, on_call=progress.update)
    load_after = os.getloadavg()
    ms = medians(times)
    rows = [[name, ms[name], f"{median_ratio(times['ours'], times[name]):.2f}"] for name in calls]
    table = markdown_table(["step", "ms (median)", "ours / it"], rows)
    table += (
        f"\nPyTorch {torch.__version__}; XLA:CPU uses every core ({os.cpu_count()} CPUs); load "
        f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min)\n"
    )
    print(table, end="")
    write_results(
        args.out or Path("benchmarks/results/transformer_step.json"),
        {
            "benchmark": "lm_step --model transformer",
            "machine": machine_info(),
            "preset": "transformer-cpu (softmax head)",
            "step": "one Trainer.window_step / one PyTorch step: dropout, forward, loss, "
            "backward, clip, AdamW",
            "ratio": "median over repetitions of ours / the other, same repetition",
            "repeats": repeats,
            "load_average": [load_before, load_after],
            "step_ms": ms,
            "ours_over": {name: median_ratio(times["ours"], times[name]) for name in calls},
            "times_ms": times,
            "torch": torch.__version__,
        },
        table,
    )


if __name__ == "__main__":
    main()
