"""The singular spectrum of a run's log-probabilities, written to a folder (the rank of Kanai et al.
2018's Table 3 and Fig. 1, for a trained model).

:func:`write_log_prob_spectrum` streams a ``.npy`` ``[T, M]`` (or a folder of blocks) through
:func:`bottleneck.spectrum_streaming.log_prob_spectrum` and writes ``results.json``,
``spectrum.csv`` and ``spectrum.png`` (singular value against index, log scale, ``d + 2`` dashed);
``experiments/rank.py --mode model`` and the study's ranked cells call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from bottleneck import spectrum_streaming as ss
from bottleneck.runs.cli import pyplot
from bottleneck.runs.folder import RunDir


@dataclass(frozen=True)
class SpectrumOptions:
    """What of the log-probs is analysed and kept (``experiments/rank.py``'s model-mode flags)."""

    hidden_size: int | None = None  # the model's d, for the d + 2 line
    max_vocab: int = 12_000  # analyse a random subset of this many columns if M > it
    max_tokens: int | None = None  # analyse a random subset of this many rows if T > it
    block_rows: int = 1024  # rows read at a time
    max_json_values: int = 5000  # singular values kept in results.json (all in the CSV)
    energy: float = 0.99  # for the effective rank
    seed: int = 0  # of the subsets


def write_log_prob_spectrum(
    log_probs: str, run: RunDir, options: SpectrumOptions = SpectrumOptions()
) -> dict[str, Any]:
    """The spectrum of the log-probs at ``log_probs`` (a ``.npy`` ``[T, M]`` or a folder of
    ``.npy`` blocks); writes ``results.json``, ``spectrum.csv`` and ``spectrum.png`` to ``run``
    and returns the ranks' row."""
    spectrum = ss.log_prob_spectrum(
        log_probs,
        max_vocab=options.max_vocab,
        max_tokens=options.max_tokens,
        seed=options.seed,
        block_rows=options.block_rows,
        progress=True,
    )
    values = spectrum.singular_values
    notes = subsampling_notes(spectrum, options)
    for note in notes:
        print(f"note: {note}")
    row = {
        "tokens": spectrum.total_rows,
        "vocab": spectrum.total_columns,
        "rows_analysed": spectrum.num_rows,
        "columns_analysed": spectrum.num_columns,
        "numerical_rank": spectrum.numerical_rank(),
        "effective_rank": spectrum.effective_rank(options.energy),
    }
    if options.hidden_size is not None:
        row["d+2"] = options.hidden_size + 2
    kept = values[: options.max_json_values]
    run.write_json(
        "results.json",
        {
            "mode": "model",
            "log_probs": log_probs,
            "files": [str(f) for f in ss.log_prob_files(log_probs)],
            **row,
            "hidden_size": options.hidden_size,
            "dtype": str(spectrum.dtype),
            "eps": ss.rank_eps(spectrum.dtype),
            "tolerance": spectrum.tolerance(),
            "tolerance_formula": "0.5 * sqrt(rows_analysed + columns_analysed + 1) * sigma_max * eps",
            "energy": options.energy,
            "columns_subsampled": spectrum.columns is not None,
            "rows_subsampled": spectrum.rows is not None,
            "subsample_seed": options.seed,
            "rank_is_lower_bound": spectrum.columns is not None or spectrum.rows is not None,
            "notes": notes,
            "method": "sqrt of the eigenvalues of the float64 Gram matrix A^T A, streamed in row blocks",
            "num_singular_values": int(values.size),
            "singular_values_truncated": bool(values.size > kept.size),
            "singular_values": kept,
        },
    )
    run.write_csv(
        "spectrum.csv",
        [{"index": i + 1, "singular_value": float(v)} for i, v in enumerate(values)],
    )
    plot_model_spectrum(spectrum, options, run)
    return row


def subsampling_notes(spectrum: ss.StreamingSpectrum, options: SpectrumOptions) -> list[str]:
    """Human-readable notes on what was subsampled (also stored in results.json)."""
    notes = []
    if spectrum.columns is not None:
        notes.append(
            f"vocabulary subsampled: {spectrum.num_columns} of {spectrum.total_columns} columns "
            f"(random, seed {options.seed}, max_vocab); the rank is a lower bound on the full one"
        )
    if spectrum.rows is not None:
        notes.append(
            f"tokens subsampled: {spectrum.num_rows} of {spectrum.total_rows} rows "
            f"(random, seed {options.seed} + 1, max_tokens); the rank is a lower bound"
        )
    return notes


def plot_model_spectrum(
    spectrum: ss.StreamingSpectrum, options: SpectrumOptions, run: RunDir
) -> None:
    """spectrum.png (Kanai Fig. 1): singular value against index, log y; d + 2 dashed."""
    values = spectrum.singular_values
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    index = np.arange(1, values.size + 1)
    positive = values > 0  # log axis: exact zeros (clipped round-off) cannot be drawn
    zeros = int(values.size - positive.sum())
    label = "log-prob matrix" + (f" ({zeros} zeros not drawn)" if zeros else "")
    ax.plot(index[positive], values[positive], lw=1.2, label=label)
    ax.axhline(spectrum.tolerance(), color="grey", ls=":", label="rank threshold")
    if options.hidden_size is not None:
        ax.axvline(
            options.hidden_size + 2, color="k", ls="--", label=f"d + 2 = {options.hidden_size + 2}"
        )
    ax.set_yscale("log")
    ax.set_xlabel("index")
    ax.set_ylabel("singular value")
    subsampled = (
        " (subsampled)" if spectrum.columns is not None or spectrum.rows is not None else ""
    )
    ax.set_title(f"Singular values of A [{spectrum.num_rows} x {spectrum.num_columns}]{subsampled}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run.path("spectrum.png"), dpi=120)
    plt.close(fig)
