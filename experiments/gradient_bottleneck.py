"""The gradient bottleneck during training: how much of each head's loss gradient reaches the trunk.

    python experiments/gradient_bottleneck.py --data_dir DIR [--d 16] [--steps 500]

Godey & Artzi (2026): a head with input ``h`` in R^d passes back to the trunk only the part of
the gradient at its output that lies in the column space of its Jacobian, ``||P_J g|| / ||g||``
of ``g = p - e_y`` (:func:`bottleneck.head_gradient_ratio`; for softmax ``J = W``, for a
pointwise map ``J = diag(...) W``, for a mixture ``J`` is the Jacobian of its log-probabilities).
Every head's ``J`` has rank at most ``d``: no head widens that column space, but each chooses
which ``d`` directions it is. For each head this trains the converged study's Transformer
(``language_model.py transformer-study``, the head at width ``--d``; all of the
corpus's words) from the same seed for ``--steps`` steps and, every ``--every`` steps, measures
the ratio at the first ``--positions`` validation positions (whole windows), with the training
loss of the steps since the last measurement.

Writes OUT/config.json, OUT/heads/HEAD.json (each head's curve, written when the head finishes:
an interrupted run resumes at the first unfinished head), OUT/gradient_bottleneck.json, its
summary as a Markdown table (.md), and OUT/gradient_bottleneck.png (median ratio against step,
one line per head, quartiles shaded).
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import functools
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bottleneck as bn
from bottleneck.data import batchify
from bottleneck.nn.presets import HeadName
from bottleneck.runs import language_model, markdown_table, open_run, parse_config, progress, pyplot
from bottleneck.runs import rows as store
from bottleneck.runs.cli import Checked, Count, one_line_errors
from bottleneck.runs.folder import config_changes, to_jsonable
from bottleneck.runs.language_model import head_inputs, validation_windows

# The [M, d] Jacobians of 64 positions at a time.
gradient_ratios = nnx.jit(functools.partial(bn.head_gradient_ratio, batch_size=64))

HEADS = ("softmax", "sigsoftmax", "plif", "mos", "mixtape")


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """The share of the loss gradient each head passes back, along training."""

    #: the language model each head trains in (experiments/language_model.py's config; the head
    #: and its width d are set per head, the corpus is prepared under --out_dir)
    trunk: language_model.Config = replace(language_model.PRESETS["transformer-study"], seed=1)
    heads: tuple[HeadName, ...] = HEADS
    d: Count = 16  # the head's input width
    steps: Count = 500  # training steps per head
    every: Count = 25  # steps between measurements
    positions: Count = 256  # validation positions measured (whole windows)
    out_dir: str = "runs/gradient_bottleneck"  # output folder

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.heads:
            raise ValueError("heads must name at least one head")
        for head in self.heads:  # each head with the trunk's options checks itself
            replace(self.trunk.head, name=head)


# A CLI check in seconds: the fixture corpus, a tiny trunk, two heads.
PRESETS = {
    "smoke": Config(
        trunk=replace(language_model.PRESETS["transformer-smoke"], seed=1),
        heads=("softmax", "mos"),
        d=4,
        steps=4,
        every=2,
        positions=8,
    ),
}


def train_head(config: Config, head: str) -> dict[str, Any]:
    """One head's curve: step, training loss since the last point, ratio quartiles."""
    # The trunk with this head at width d (not a run folder of its own).
    cell = config.trunk.cell(
        head, config.d, out_dir=config.out_dir, tfds_dir=str(Path(config.out_dir) / "tfds")
    )
    corpus = cell.data.load(config.out_dir)
    trainer = language_model.build_trainer(cell, corpus, None)
    inputs, targets = validation_windows(
        np.asarray(corpus.validation), config.positions, cell.data.bptt, "--positions"
    )
    batched = batchify(np.asarray(corpus.train), cell.data.batch_size)
    points, losses, step = [], [], 0
    start = time.perf_counter()

    def measure() -> None:
        trunk = trainer.model.model  # the model behind the run loop's interface
        h = head_inputs(trunk, inputs)
        ratios = np.asarray(gradient_ratios(trunk.head, h, jnp.asarray(targets))).reshape(-1)
        q1, median, q3 = np.quantile(ratios, [0.25, 0.5, 0.75])
        # The step losses stay on the device until here: no host sync per training step.
        loss = float(np.mean(jax.device_get(losses))) if losses else None
        points.append(dict(step=step, train_loss=loss, median=median, q1=q1, q3=q3,
                           mean=float(ratios.mean())))  # fmt: skip
        losses.clear()

    measure()
    bar = progress(None, total=config.steps, desc=f"{head} (d = {config.d})")
    epochs = (cell.data.train_windows(batched, epoch, cell.seed) for epoch in itertools.count())
    windows = itertools.islice(itertools.chain.from_iterable(epochs), config.steps)
    carry = trainer.initial_carry(cell.data.batch_size)  # carried across epochs
    for _, _, metrics in trainer.train_windows(carry, windows, bucket=cell.data.seq_len_bucket):
        losses.append(metrics.nll)
        step += 1
        bar.update()
        if step % config.every == 0 or step == config.steps:
            measure()
            bar.set_postfix(ratio=f"{points[-1]['median']:.3f}")
    bar.close()
    return {
        "head": head,
        "d": config.d,
        "params": sum(x.size for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))),
        "seconds": time.perf_counter() - start,
        "points": [{k: v if v is None else float(v) for k, v in p.items()} for p in points],
    }


def plot(curves: list[dict[str, Any]], path: Path, d: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, curve in enumerate(curves):
        steps = [p["step"] for p in curve["points"]]
        ax.plot(steps, [p["median"] for p in curve["points"]], color=f"C{i}", label=curve["head"])
        ax.fill_between(steps, [p["q1"] for p in curve["points"]],
                        [p["q3"] for p in curve["points"]], color=f"C{i}", alpha=0.2)  # fmt: skip
    ax.set_xlabel("training step")
    ax.set_ylabel("‖P_J g‖ / ‖g‖ (median, quartiles)")
    ax.set_title(f"Share of the loss gradient passed to the trunk, d = {d}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(config: Config) -> list[dict[str, Any]]:
    run_dir = open_run(config.out_dir, config, resume=True)
    heads_dir = run_dir.path("heads")
    heads_dir.mkdir(exist_ok=True)
    # A head's curve depends on neither the folder nor the other heads of the run.
    recorded = {**to_jsonable(config), "out_dir": None, "heads": None}
    curves = []
    for head in config.heads:
        path = heads_dir / f"{head}.json"
        saved = json.loads(path.read_text()) if path.exists() else None
        if saved is not None and not config_changes(saved["config"], config, ("out_dir", "heads")):
            curves.append(saved["curve"])
            continue
        curve = train_head(config, head)
        store.write_json(path, {"config": recorded, "curve": curve}, indent=1)
        curves.append(curve)
    summary = [
        {"head": c["head"], "d": c["d"], "start": c["points"][0]["median"],
         "end": c["points"][-1]["median"], "end_train_loss": c["points"][-1]["train_loss"],
         "seconds": c["seconds"]}
        for c in curves
    ]  # fmt: skip
    run_dir.write_json("gradient_bottleneck.json", {"summary": summary, "curves": curves})
    plot(curves, run_dir.path("gradient_bottleneck.png"), config.d)
    table = markdown_table(summary, floatfmt=".4g")
    print(table)
    run_dir.write_page(
        "gradient_bottleneck.md",
        f"Share of the loss gradient passed back to the trunk, d = {config.d}",
        table,
    )
    print(f"wrote {run_dir.root}/gradient_bottleneck.json, .md and .png")
    return summary


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config = parse_config(Config, PRESETS, argv)
    with one_line_errors(config):
        return run(config)


if __name__ == "__main__":
    main(sys.argv[1:])
