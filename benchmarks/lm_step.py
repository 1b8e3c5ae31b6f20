"""Seconds per AWD-LSTM training step with each output head, as ratios to softmax.

One full training step of ``bottleneck.train.lm.LanguageModelTrainer`` (dropout masks, forward,
the head's chunked loss + AR/TAR, backward, global-norm clipping, SGD with weight decay) at the
paper's PTB shapes: batch 20, bptt 70, vocabulary 10,000, emsize 400, nhid 1150, 3 layers,
tied embeddings, for the heads

* ``softmax``, ``sigsoftmax`` and ``plif`` (10^5 knots, its own learning rate) on that model;
* ``mos``: Yang et al.'s MoS with its own PTB sizes (emsize 280, nhid 960, nhidlast 620,
  K = 15, latent dropout 0.29) at the same batch and bptt, so the same tokens per step: the
  comparison behind the seeds' "MoS ~150 s vs ~60 s per PTB epoch" (2.5x);
* ``mos_awd``: K = 15 components on the AWD-LSTM model itself (latents of 400), for reference.

All candidates are timed interleaved in one process (``benchmarks/_timing.py``); the ratio of a
head is the median over repetitions of its step time over softmax's in the same repetition.
Targets (Ganea et al.'s slides: PLIF +17% per epoch, MoS 2.5x): PLIF <= 1.10x, MoS <= 2.5x.

Run from the repository root (a few minutes on a GPU; ``--quick`` ~5 minutes on 2 CPU cores):

    python benchmarks/lm_step.py [--quick] [--heads softmax,plif] [--out benchmarks/results/lm_step.json]

``--quick`` times 3 repetitions instead of 10. The markdown table is printed and saved next to
the JSON file with the suffix ``.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
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

from bottleneck.data import BpttWindow
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel
from bottleneck.train import make_optimizer
from bottleneck.train.lm import LanguageModelTrainer, pad_window

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
}
TARGETS = {"plif": 1.10, "mos": 2.5}


def step_call(name: str, window: Any) -> Callable[[], Any]:
    """A zero-argument call running one training step of candidate ``name``."""
    head, options = CANDIDATES[name]
    model = AWDLSTM(VOCAB, head=head, rngs=nnx.Rngs(0), **options)
    tx = make_optimizer(
        30.0,
        optimizer="sgd",
        plif_learning_rate=0.02 if head == "plif" else None,
        grad_clip_norm=0.25,
        weight_decay=1.2e-6,
    )
    trainer = LanguageModelTrainer(AWDLSTMLanguageModel(model, alpha=2.0, beta=1.0), tx)
    carry = trainer.initial_carry(BATCH)

    def call() -> Any:
        # The metrics come out of the same compiled step as the new state: waiting on them
        # waits for the whole step. The carry is not fed back, so every step does equal work.
        return trainer.train_step(carry, window, 1.0, averaging=False)[1]

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions instead of 10")
    parser.add_argument(
        "--heads",
        default=",".join(CANDIDATES),
        help="comma-separated subset of " + ", ".join(CANDIDATES),
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_step.json"))
    args = parser.parse_args()
    names = [name.strip() for name in args.heads.split(",") if name.strip()]
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        parser.error(f"unknown head(s) {unknown}; choose from {', '.join(CANDIDATES)}")
    if "softmax" not in names:
        names.insert(0, "softmax")  # the reference of every ratio
    repeats = 3 if args.quick else 10

    ids = np.random.default_rng(0).integers(0, VOCAB, (BPTT + 1, BATCH)).astype(np.int32)
    window = pad_window(BpttWindow(ids[:-1], ids[1:], BPTT, 1.0), BPTT)
    calls = {name: step_call(name, window) for name in names}
    progress = tqdm(total=len(calls) * (repeats + 1), desc="timing", unit="step")
    times = time_interleaved(calls, repeats, on_call=progress.update)
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
    for result in results.values():
        target = result["target_ratio"]
        result["meets_target"] = None if target is None else result["ratio_to_softmax"] <= target
    header = ["head", "model", "step ms", "ratio to softmax", "target"]
    rows = [
        [
            name,
            "MoS PTB sizes (280/960/620), K=15" if name == "mos" else
            "AWD-LSTM 400/1150" + (", K=15" if name == "mos_awd" else ""),
            result["step_ms"],
            f"{result['ratio_to_softmax']:.2f}",
            "" if result["target_ratio"] is None else
            f"<= {result['target_ratio']:.2f} ({'met' if result['meets_target'] else 'missed'})",
        ]
        for name, result in results.items()
    ]  # fmt: skip
    table = markdown_table(header, rows)
    print(table, end="")
    write_results(
        args.out,
        {
            "benchmark": "lm_step",
            "machine": machine_info(),
            "vocab_size": VOCAB,
            "batch_size": BATCH,
            "bptt": BPTT,
            "repeats": repeats,
            "step": "one LanguageModelTrainer.train_step: masks, forward, chunked head loss + "
            "AR/TAR, backward, clip 0.25, SGD lr 30 + weight decay 1.2e-6",
            "ratio": "median over repetitions of step_ms / softmax step_ms (same repetition)",
            "results": results,
        },
        table,
    )


if __name__ == "__main__":
    main()
