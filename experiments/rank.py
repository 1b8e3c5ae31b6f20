"""Yang et al. 2018 / Kanai et al. 2018 (Sec. 4.3): the rank of the log-probability matrix.

A head maps hidden states H [N, d] to log-probabilities A [N, M]. For log-softmax,
A = H W^T + 1 b^T - lse(H W^T + b) 1^T, so rank(A) <= d + 2 with an output bias (d + 1 without):
the softmax bottleneck. Kanai et al. (Table 3, Figs 1-2) measure 402 = d + 2 for softmax with
d = 400 and larger ranks for sigsoftmax, the sigmoid and ReLU normalizers, MoS and MoSS. Ranks are
numerical ranks with the Numerical Recipes threshold 0.5 sqrt(m + n + 1) sigma_max eps (float32
eps here), as in both papers; the effective rank (smallest k holding `energy` of sum sigma^2) is
reported alongside.

--mode random: for each head and d, H ~ N(0, I) [num_contexts, d] (the same H for every head at
a given d) and a freshly initialised head with vocabulary M = vocab_size. Two changes to the init,
both recorded in config.json: the output bias is drawn from N(0, bias_std^2) so that it counts
(bias_std 0 gives d + 1 for softmax), and the decoder W is redrawn from N(0, logit_std^2 / d') so
the logits W h have standard deviation about logit_std (d' = the decoder's input width; exactly
logit_std for the single-component heads, less for mixtures, whose tanh latents are < 1). The
heads' own U(-0.1, 0.1) init (`--logit_std None`) gives logits of std 0.16-0.5, where every
normalizer is nearly linear and the log-probs are nearly the constant -log M: the numerical
ranks still separate softmax from the rest, but the effective rank is 1 for all but ReLU. PLIF
starts with plif_noise = 1 (otherwise it is the identity, i.e. softmax). The effective rank is
that of the raw log-prob matrix, whose leading direction is the near-constant -log M offset: at
energy 0.99 it stays 1 for heads whose log-probs vary little around it (sigmoid, MoS, MoSS).
Precision: the log-probs and their SVD are float32, and that is what is reported. Checked: for
softmax the float32 SVD puts sigma_{d+3} at 1.5e-7 to 3.6e-7 sigma_max, 7-16x below the threshold
of 2.3e-6 sigma_max at N = 512, M = 1024 (`tail_over_tol` in the results), and a float64 SVD
of the same float32 matrix (tail 2.8e-9 sigma_max: the entries' own round-off) gives the same
numerical rank for every head and d of the default grid. So float32 round-off does not inflate
softmax's rank, and no float64 pass is needed.

--mode model: the log-probs of a trained model on a data split, --log_probs PATH to a .npy [T, M]
(memory-mapped) or a folder of .npy blocks [T_i, M] (sorted by name, stacked along rows). The
spectrum comes from the float64 Gram matrix accumulated block by block
(bottleneck.spectrum_streaming): singular values are resolved to ~1e-8 sigma_max, far below the
float32 threshold (~1e-5 sigma_max at these sizes), so the rank is unaffected. If M > max_vocab
(WikiText-2 has 33,278) a seeded random subset of max_vocab vocabulary columns is analysed, and
max_tokens subsamples rows likewise; a subsample's rank is a lower bound on the full one, and the
output says so.

    python experiments/rank.py smoke --out_dir /tmp/rank       # seconds
    python experiments/rank.py --mode random                            # ~1 minute on 2 CPU cores
    python experiments/rank.py --mode model --log_probs test_log_probs.npy --hidden_size 400

Writes to --out_dir: config.json and results.json always; random mode: results.csv,
rank_vs_d.png (numerical rank against d, one line per head, d + 2 dashed) and spectra_d{d}.png
(normalised singular values for the largest d); model mode: spectrum.csv and spectrum.png
(Kanai's Fig. 1: singular value against index, log scale, a dashed line at d + 2).
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Annotated, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bottleneck as bn
from bottleneck import nn
from bottleneck import spectrum_streaming as ss
from bottleneck.nn import HEAD_NAMES, make_head
from bottleneck.nn.presets import HeadName
from bottleneck.runs import (
    RunDir,
    UsageError,
    markdown_table,
    open_run,
    parse_config,
    progress,
    pyplot,
)
from bottleneck.runs.cli import (
    Checked,
    Count,
    Interval,
    NonNegative,
    Positive,
    one_line_errors,
)
from bottleneck.runs.log_prob_spectrum import SpectrumOptions, write_log_prob_spectrum


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Ranks of log-probability matrices: random heads (--mode random) or a model's (--mode model)."""

    mode: Literal["random", "model"] = "random"
    # --mode random:
    heads: tuple[HeadName, ...] = (
        "softmax", "sigsoftmax", "sigmoid", "relu", "plif", "monotone_mlp", "mos", "moss",
    )  # fmt: skip
    dims: tuple[Count, ...] = (8, 16, 32, 64)  # hidden sizes d
    num_contexts: Count = 512  # N, rows of H
    vocab_size: Annotated[int, Interval("[2, inf)")] = 1024  # M
    #: redraw W so that W h has about this std; None keeps the head's init
    logit_std: Positive | None = 1.0
    bias_std: NonNegative[float] = 1.0  # std of the random output bias (0: no bias, rank d + 1)
    num_components: Count = 15  # K of MoS / MoSS
    num_knots: Count = 100_000  # PLIF knots
    plif_noise: NonNegative[float] = 1.0  # std of the PLIF slope noise (0: identity = softmax)
    num_hidden: Count = 16  # monotone MLP width
    # --mode model
    log_probs: str | None = None  # a .npy [T, M] or a folder of .npy blocks [T_i, M]
    hidden_size: Count | None = None  # the model's d, for the d + 2 line
    max_vocab: Count = 12_000  # analyse a random subset of this many columns if M > it
    max_tokens: Count | None = None  # analyse a random subset of this many rows if T > it
    block_rows: Count = 1024  # rows read at a time
    max_json_values: Count = 5000  # singular values kept in results.json (all in the CSV)
    # both
    energy: Annotated[float, Interval("(0, 1]")] = 0.99  # for the effective rank
    seed: int = 0
    out_dir: str = "runs/rank"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.heads or not self.dims:
            raise ValueError("heads and dims must each name at least one value")
        if self.mode == "random":  # each head's own checks (built abstractly), before writing
            nn.check_heads(self.heads, **dataclasses.asdict(self))
        if self.mode == "model" and self.log_probs is None:
            raise ValueError("--log_probs PATH is required in model mode")


PRESETS = {
    "smoke": Config(
        dims=(4, 8),
        num_contexts=64,
        vocab_size=128,
        num_components=4,
        num_knots=1000,
        num_hidden=8,
    ),  # fmt: skip
    # Kanai's d = 400 at a size an in-memory SVD still handles (2048 x 4096).
    "paper": Config(dims=(50, 100, 200, 400), num_contexts=2048, vocab_size=4096),
}


# ----------------------------------------------------------------------------------------------
# --mode random


def random_head_log_probs(
    config: Config, head: str, hidden: jax.Array, key: jax.Array
) -> jax.Array:
    """``[N, M]`` float32 log-probs of a random ``head`` at ``hidden [N, d]`` (see module doc)."""
    params_key, bias_key, decoder_key = jax.random.split(key, 3)
    dim = hidden.shape[-1]
    model = make_head(
        head,
        dim,
        config.vocab_size,
        rngs=nnx.Rngs(params=params_key),
        use_bias=config.bias_std > 0,
        **nn.head_options(head, **dataclasses.asdict(config)),
    )
    if model.bias is not None:
        # A zero bias would hide the bias's rank-one direction: Kanai's d + 2 needs a real one.
        model.bias[...] = config.bias_std * jax.random.normal(bias_key, model.bias.shape)
    if config.logit_std is not None:
        features = model.decoder.shape[-1]
        scale = config.logit_std / float(np.sqrt(features))
        model.decoder[...] = scale * jax.random.normal(decoder_key, model.decoder.shape)
    return model(hidden)


def analyse_random(config: Config, head: str, dim: int, log_probs: jax.Array) -> dict:
    """One row of results: ranks of ``log_probs [N, M]`` and where its spectrum crosses d + 2."""
    values = np.asarray(bn.singular_values(log_probs), dtype=np.float64)
    n, m = log_probs.shape
    tol = ss.numerical_rank_tolerance(float(values[0]), n, m, np.float32)
    bound = dim + 2 if config.bias_std > 0 else dim + 1
    # sigma_{bound+1} / tol < 1 means softmax's rank is not inflated by round-off.
    tail = float(values[bound] / tol) if bound < values.size else None
    return {
        "head": head,
        "d": dim,
        "d+2": dim + 2,
        "bound": bound,
        "max_rank": min(n, m),
        "numerical_rank": ss.numerical_rank_from_singular_values(values, n, m, tol=tol),
        "effective_rank": ss.effective_rank_from_singular_values(values, config.energy),
        "tolerance": tol,
        "sigma_max": float(values[0]),
        "tail_over_tol": tail,
        "singular_values": values.tolist(),
    }


def run_random(config: Config, run: RunDir) -> list[dict]:
    """Every (d, head): the log-prob matrix's ranks; writes results.json/.csv and the plots."""
    root = jax.random.key(config.seed)
    rows: list[dict] = []
    grid = [(d, h) for d in config.dims for h in config.heads]
    bar = progress(grid, desc="rank")
    for dim, head in bar:
        bar.set_postfix(head=head, d=dim)
        start = time.perf_counter()
        dim_key = jax.random.fold_in(root, dim)
        # The same H for every head at this d; each head's parameters from its own key.
        hidden = jax.random.normal(
            jax.random.fold_in(dim_key, 0), (config.num_contexts, dim), jnp.float32
        )
        head_key = jax.random.fold_in(dim_key, 1 + HEAD_NAMES.index(head))
        log_probs = random_head_log_probs(config, head, hidden, head_key)
        row = analyse_random(config, head, dim, log_probs)
        row["seconds"] = time.perf_counter() - start
        run.log_metrics({k: v for k, v in row.items() if k != "singular_values"})
        rows.append(row)
    table = [{k: v for k, v in row.items() if k != "singular_values"} for row in rows]
    run.write_json(
        "results.json",
        {
            "mode": "random",
            "num_contexts": config.num_contexts,
            "vocab_size": config.vocab_size,
            "dtype": "float32",
            "tolerance": "0.5 * sqrt(N + M + 1) * sigma_max * eps(float32)",
            "energy": config.energy,
            "runs": rows,
        },
    )
    run.write_csv("results.csv", table)
    plot_rank_vs_d(rows, config, run)
    plot_random_spectra(rows, config, run)
    return table


def plot_rank_vs_d(rows: list[dict], config: Config, run: RunDir) -> None:
    """rank_vs_d.png: numerical rank against d, one line per head; d + 2 dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for head in config.heads:
        mine = sorted((r for r in rows if r["head"] == head), key=lambda r: r["d"])
        ax.plot([r["d"] for r in mine], [r["numerical_rank"] for r in mine], "o-", label=head)
    dims = np.asarray(sorted(config.dims))
    ax.plot(dims, dims + 2, "k--", label="d + 2 (softmax bound)")
    ax.axhline(min(config.num_contexts, config.vocab_size), color="grey", ls=":", label="min(N, M)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("hidden size d")
    ax.set_ylabel("numerical rank of the log-prob matrix")
    ax.set_title(f"Random heads, N = {config.num_contexts}, M = {config.vocab_size}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(run.path("rank_vs_d.png"), dpi=120)
    plt.close(fig)


def plot_random_spectra(rows: list[dict], config: Config, run: RunDir) -> None:
    """spectra_d{d}.png for the largest d: sigma_i / sigma_1 against i, log scale, per head."""
    dim, plt = max(config.dims), pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in (r for r in rows if r["d"] == dim):
        values = np.asarray(row["singular_values"])
        ax.plot(np.arange(1, values.size + 1), values / values[0], label=row["head"])
    relative_tol = rows[0]["tolerance"] / rows[0]["sigma_max"]  # the same for every head
    ax.axvline(dim + 2, color="k", ls="--", label="d + 2")
    ax.axhline(relative_tol, color="grey", ls=":", label="rank threshold")
    ax.set_yscale("log")
    ax.set_xlabel("index i")
    ax.set_ylabel("sigma_i / sigma_1")
    ax.set_title(f"Singular values of random heads' log-probs, d = {dim}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(run.path(f"spectra_d{dim}.png"), dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    config = parse_config(Config, PRESETS, argv)
    if config.mode == "model":
        with one_line_errors(config):  # headers only: fail now, not after a run
            try:
                ss.open_log_probs(config.log_probs)
            except FileNotFoundError as err:
                raise UsageError(str(err)) from None
    run = open_run(config.out_dir, config)
    start = time.perf_counter()
    if config.mode == "random":
        rows = run_random(config, run)
        columns = ["head", "d", "d+2", "numerical_rank", "effective_rank"]
        files = f"results.json, results.csv, rank_vs_d.png, spectra_d{max(config.dims)}.png"
    else:
        options = SpectrumOptions(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(SpectrumOptions)}
        )
        rows = [write_log_prob_spectrum(config.log_probs, run, options)]
        columns = None
        files = "results.json, spectrum.csv, spectrum.png"
    seconds = time.perf_counter() - start
    print(markdown_table(rows, columns))
    print(f"\n{config.mode} mode, {seconds:.1f} s; wrote config.json, {files} to {run.root}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
