"""How peaked can a trained run's predictions get: logit spread, latent saturation, mixture prior.

    python experiments/logit_spread.py --run_dir runs/tf/mos [--tokens 4096]

A head's log-probabilities normalize its logits ``z_v = w_v . x + b_v``, so how far apart the
logits of one context can lie bounds how peaked its distribution can be, and without the bias
``max_v z_v - min_v z_v <= 2 max_v ||w_v|| ||x||``. A plain head's input ``x = h`` scales with
the model (a Transformer's final norm has a learned scale). A mixture's (MoS, Yang et al. 2018)
inputs are its latents ``h_k = tanh(P_k h)``, so ``||h_k|| <= sqrt(d')``: once they saturate, only
the decoder rows ``||w_v||`` can widen the spread, and with a tied embedding those are the input
embedding too. This script reloads a ``language_model.py`` run (its config, vocabulary and best
parameters, as ``generate.py`` does) and measures, over the first ``--tokens`` validation tokens
read in windows of the run's ``bptt`` (each window from its own start, no carried state):

* ``logit_spread``: the mean over positions and components of max_v z_v - median_v z_v, bias
  left out (the decoder's outputs, before a pointwise map such as PLIF's), and ``spread_bound``:
  the mean of 2 max_v ||w_v|| ||x||, its upper bound;
* ``input_norm``: the median ||x|| of the decoder's inputs (the latents for a mixture) and, for a
  mixture, ``latent`` (its latent map), ``latent_saturation``: the fraction of latent units with
  |h_k,i| > 0.95 (tanh latents only: a linear latent is unbounded), and ``prior_max``: the mean
  largest mixture weight (MoS's context prior; Mixtape has none);
* ``decoder_row_norm``: the median ||w_v|| over the vocabulary;
* ``entropy`` (nats) and ``max_prob``: the mean entropy and largest probability of the predicted
  distributions.

Writes RUN/logit_spread.json and prints it. It holds ``tokens x K x M`` float32 logits at once
(4096 tokens of a 15-component MoS over WikiText-2's 33,278 words: 8 GB): lower ``--tokens`` for
large heads.
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bottleneck.runs import UsageError, parse_config
from bottleneck.runs.cli import Checked, Count, one_line_errors
from bottleneck.runs.language_model import head_inputs, load_run

SATURATED = 0.95


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Logit spread and latent saturation of a trained language_model.py run's head."""

    run_dir: str  # the --out_dir of a language_model.py run
    tokens: Count = 4096  # validation tokens measured (whole windows)


def measure(model: Any, windows: np.ndarray, vocab_size: int) -> dict[str, Any]:
    """The statistics of the module docstring for a model and token windows ``[B, T]``."""
    head = model.head
    h = head_inputs(model, windows)
    rows = np.asarray(head.decoder[...], np.float32)[:vocab_size]  # padding rows never score
    row_norms = np.linalg.norm(rows, axis=1)
    stats: dict[str, Any] = {"decoder_row_norm": float(np.median(row_norms))}
    if head.is_mixture:
        latents, log_prior = head.components(h)
        inputs = np.asarray(latents, np.float32)  # [B, T, K, d']
        stats["latent"] = head.latent_kind
        if head.latent_kind == "tanh":  # only a bounded latent saturates
            stats["latent_saturation"] = float(np.mean(np.abs(inputs) > SATURATED))
        if log_prior is not None:  # Mixtape's gates depend on the token: no context prior
            stats["prior_max"] = float(np.mean(np.exp(np.asarray(log_prior)).max(axis=-1)))
        stats["latent_width"] = int(inputs.shape[-1])
    else:
        inputs = np.asarray(h, np.float32)[..., None, :]  # one component
    input_norms = np.linalg.norm(inputs, axis=-1)
    logits = inputs @ rows.T  # [B, T, K, M], no bias
    spread = logits.max(axis=-1) - np.median(logits, axis=-1)
    bound = 2.0 * row_norms.max() * input_norms
    log_probs = np.asarray(head(h), np.float32)
    probs = np.exp(log_probs)
    stats.update(
        input_norm=float(np.median(input_norms)),
        logit_spread=float(spread.mean()),
        spread_bound=float(bound.mean()),
        entropy=float(-(probs * log_probs).sum(axis=-1).mean()),
        max_prob=float(probs.max(axis=-1).mean()),
        tokens=int(windows.size),
    )
    return stats


def run(config: Config) -> dict[str, Any]:
    run_config, vocabulary, model = load_run(config.run_dir)
    validation = np.asarray(run_config.data.load(config.run_dir).validation)
    length = run_config.data.bptt
    count = min(config.tokens, len(validation)) // length
    if count < 1:
        raise UsageError(
            f"--tokens {config.tokens} and the run's validation split ({len(validation)} "
            f"tokens) hold no whole window of bptt {length}"
        )
    windows = validation[: count * length].reshape(count, length)
    stats = {
        "run_dir": config.run_dir,
        "model": run_config.model.family,
        "head": run_config.head.name,
        **measure(model, windows, len(vocabulary)),
    }
    path = Path(config.run_dir) / "logit_spread.json"
    path.write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))
    print(f"wrote {path}")
    return stats


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(Config, argv=argv)
    with one_line_errors(config):
        return run(config)


if __name__ == "__main__":
    main(sys.argv[1:])
