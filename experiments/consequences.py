"""The bottleneck's consequences beyond rank, measured on trained language_model.py runs.

    python experiments/consequences.py --run_dirs RUN1 RUN2 [--tokens 2048] [--out FILE]

For each run (its config, vocabulary and best parameters, as ``generate.py`` loads them):

* ``unargmaxable``: the tokens no hidden state makes the argmax of the decoder's logits
  ``W x + b`` (:func:`bottleneck.unargmaxable_tokens`: an exact LP per token, over all of
  ``R^d``), their count and their share of the training tokens (``unargmaxable_train_share``).
  For a plain head with a monotone pointwise map (PLIF, the monotone MLP) or sigsoftmax, whose
  log-score ``2z - softplus(z)`` is increasing, this is the head's own unargmaxable set. A mixture
  (MoS, Mixtape) mixes several decoder outputs, so its argmax need not be any component's: for
  it the script also counts how many of the decoder's unargmaxable tokens are the argmax of the
  head's own log-probabilities at some of the first ``--tokens`` validation positions
  (``unargmaxable_seen_as_argmax``; 0 for a plain head by construction).
* ``hidden_size_estimate``: :func:`bottleneck.estimate_hidden_size` of the head's full
  log-probabilities at those positions: the head's input width ``d`` for a softmax head (the
  attack of Finlayson et al. 2024 recovers it), more where a head breaks the bottleneck.
* ``gradient_ratio_median``: the median over those positions of
  :func:`bottleneck.head_gradient_ratio`, the share of the loss gradient at the head's output
  that reaches its input (Godey & Artzi 2026), for the trained model.
* ``test_nll_by_train_count``: where on the test set a head gains or loses against another: the
  mean NLL (nats) over all of the test set's whole windows, split by how often each target word
  occurs in the training data (``0-9``, ``10-99``, ``100-999``, ``1000+`` times), each with its
  number of positions, and over all of them (``all``; the test loss, up to how the run's own
  evaluation cuts the stream into windows). Paired with softmax's at the same d and seed, it
  shows on which words a head wins or loses (docs/beyond_rank.md reads the study's runs).
* ``train_nll_by_train_count``: the same over the first ``--train_tokens`` positions of the
  training stream (whole windows, no dropout), the data the run was fitted to. Test minus
  training NLL is each group's generalization gap: a head that beats softmax on the training
  words of a group and loses to it on the same group's test words overfits them.

Writes one JSON row per run to ``--out`` (default: ``consequences.json`` in the first run's
folder) and the same rows as a Markdown table beside it (``.md``), both rewritten as each run is
measured, and prints the tables (the NLL by training count, on the test set, on the training
sample and their difference, as ``NLL (minus softmax's at the same d and seed)``); where a head
is paired with softmax so, a plot beside them (``.png``) shows how its gap to softmax splits over
the groups (:func:`count_gaps`), and where none is, no plot is left there. Each row names its
run folder (``run``), times the exact LPs (``unargmaxable_seconds``) and records the code's
commit. With ``--merge`` the file gathers a
grid's rows call by call (``experiments/lm_study_grid.sh`` measures each cell as it lands): the
rows it holds for other run folders are kept, and a run measured again replaces its row;
``--fill_missing`` adds to a run's row only the measurements it lacks (those added to this
script since it was measured), recording their commit in the row's ``filled``;
``--merge_from`` adds the rows of other calls' ``--out`` files as they are (runs measured on
another machine, say a GPU's, whose weights stay there).
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bottleneck as bn
from bottleneck.runs import UsageError, code_commit, markdown_table, parse_config, progress, pyplot
from bottleneck.runs import rows as store
from bottleneck.runs.cli import Checked, Count, one_line_errors
from bottleneck.runs.folder import results_page
from bottleneck.runs.language_model import head_inputs, load_run, validation_windows

# The [M, d] Jacobians of 64 positions at a time.
gradient_ratios = nnx.jit(functools.partial(bn.head_gradient_ratio, batch_size=64))

PAGE_TITLE = (
    "Beyond rank: unargmaxable tokens, hidden size, gradient share and NLL by word frequency of "
    "trained runs"
)
TABLE_COLUMNS = (
    "run", "head", "d", "vocab_size", "unargmaxable", "unargmaxable_train_share",
    "unargmaxable_seen_as_argmax", "distinct_argmaxes", "hidden_size_estimate",
    "gradient_ratio_median", "positions",
    "unargmaxable_seconds", "commit",
)  # fmt: skip

#: Upper edges of the training-count groups of ``test_nll_by_train_count``.
TRAIN_COUNT_EDGES = (10, 100, 1000)

MERGED_NOTE = (
    "Rows gathered call by call (`--merge`); a row's `commit` is the code that measured it."
)


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Unargmaxable tokens and the hidden-size estimate of trained runs."""

    run_dirs: tuple[str, ...] = ()  # language_model.py run folders
    tokens: Count = 2048  # validation positions (whole windows) for the estimates
    #: training positions (the training stream's first whole windows) for the training NLL
    train_tokens: Count = 200_000
    out: str | None = None  # JSON file; None: RUN/consequences.json of the first run
    #: keep --out's rows of other run folders (by folder name), replacing those measured again
    merge: bool = False
    #: with --merge, a run that has a row measures only what its row lacks (a measurement added
    #: since), kept beside the row's other fields
    fill_missing: bool = False
    #: with --merge, other calls' --out files whose rows join --out's as they are (before
    #: --run_dirs are measured), replacing the rows of the same run folders
    merge_from: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.run_dirs and not self.merge_from:
            raise ValueError("--run_dirs must name at least one run folder (or --merge_from)")
        if self.merge_from and not (self.merge and self.out):
            raise ValueError("--merge_from adds rows to --out's: it needs --merge and --out")
        if self.fill_missing and not self.merge:
            raise ValueError("--fill_missing adds to --out's rows: it needs --merge")


@nnx.jit
def _target_nll(model: Any, windows: jax.Array, targets: jax.Array) -> jax.Array:
    log_probs = model.head(head_inputs(model, windows))
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def count_groups(edges: tuple[int, ...] = TRAIN_COUNT_EDGES) -> list[str]:
    """The names of the training-count groups that ``edges`` bound: ``0-9``, ..., ``1000+``."""
    lows = (0, *edges[:-1])
    return [f"{lo}-{hi - 1}" for lo, hi in zip(lows, edges, strict=True)] + [f"{edges[-1]}+"]


def nll_by_train_count(
    model: Any,
    tokens: np.ndarray,
    train_counts: np.ndarray,
    bptt: int,
    *,
    positions: int | None = None,
    flag: str = "the test set's length",
    edges: tuple[int, ...] = TRAIN_COUNT_EDGES,
    windows_per_call: int = 16,
) -> dict[str, dict[str, Any]]:
    """Mean NLL (nats) of a model's predictions of ``tokens`` (every whole window of ``bptt``,
    each read from its own start), grouped by how often each target occurs in training.

    Args:
      model: a language model as :func:`bottleneck.runs.language_model.load_run` returns it.
      tokens: a token stream ``[n]`` (the test set, or the training stream).
      train_counts: each word's count in the training data ``[vocab]``.
      bptt: the window length.
      positions: predict only the first whole windows within this many positions (None: all).
      flag: what ``positions`` is called in the error if it holds no whole window.
      edges: the groups' upper edges (exclusive), increasing: ``(10, 100)`` makes ``0-9``,
        ``10-99`` and ``100+``.
      windows_per_call: windows evaluated at once (each holds ``[bptt, vocab]`` log-probs).

    Returns:
      ``{group: {"nll": mean, "positions": count}}`` for each group of :func:`count_groups` and
      ``"all"``; a group with no position has ``nll`` None.
    """
    windows, targets = validation_windows(
        tokens, len(tokens) if positions is None else positions, bptt, flag=flag
    )
    nll = np.concatenate([
        np.asarray(_target_nll(
            model, jnp.asarray(windows[i : i + windows_per_call]),
            jnp.asarray(targets[i : i + windows_per_call]),
        ), np.float64).reshape(-1)
        for i in range(0, len(windows), windows_per_call)
    ])  # fmt: skip
    group = np.searchsorted(np.asarray(edges), train_counts[targets.reshape(-1)], side="right")
    result = {}
    for i, name in enumerate([*count_groups(edges), "all"]):
        chosen = nll if name == "all" else nll[group == i]
        mean = float(chosen.mean()) if chosen.size else None
        result[name] = {"nll": mean, "positions": int(chosen.size)}
    return result


#: A row's measurements and the fields each writes (``--fill_missing`` runs only those an
#: earlier row lacks).
MEASUREMENTS = {
    "decoder": (
        "unargmaxable", "unargmaxable_train_share", "unargmaxable_seconds", "unargmaxable_tokens",
    ),
    "validation": (
        "unargmaxable_seen_as_argmax", "distinct_argmaxes", "hidden_size_estimate",
        "gradient_ratio_median", "positions",
    ),
    "test_nll": ("test_nll_by_train_count",),
    "train_nll": ("train_nll_by_train_count",),
}  # fmt: skip


def measure_run(
    run_dir: str,
    tokens: int,
    train_tokens: int,
    measurements: tuple[str, ...] = tuple(MEASUREMENTS),
) -> dict[str, Any]:
    """The statistics of the module docstring for one run (those of ``measurements``)."""
    config, vocabulary, model = load_run(run_dir)
    corpus = config.data.load(run_dir)
    vocab_size = len(vocabulary)
    head = model.head
    row = {
        "run": Path(run_dir).name,
        "run_dir": run_dir,
        "head": config.head.name,
        "seed": config.seed,
        "latent": config.head.latent if head.is_mixture else None,
        "d": int(head.in_features),
        "vocab_size": vocab_size,
    }
    counts = np.bincount(np.asarray(corpus.train), minlength=vocab_size)
    if "decoder" in measurements or "validation" in measurements:
        decoder = np.asarray(head.decoder[...], np.float64)[:vocab_size]
        bias = None if head.bias is None else np.asarray(head.bias[...], np.float64)[:vocab_size]
        start = time.perf_counter()
        unargmaxable = bn.unargmaxable_tokens(decoder, bias)
        seconds = time.perf_counter() - start
    if "decoder" in measurements:
        row["unargmaxable"] = int(unargmaxable.size)
        row["unargmaxable_train_share"] = float(counts[unargmaxable].sum() / counts.sum())
        row["unargmaxable_seconds"] = seconds
        row["unargmaxable_tokens"] = [vocabulary.tokens[i] for i in unargmaxable[:20]]
    if "validation" in measurements:
        bptt = config.data.bptt
        windows, targets = validation_windows(np.asarray(corpus.validation), tokens, bptt)
        h = head_inputs(model, windows)
        log_probs = np.asarray(head(h), np.float32).reshape(-1, vocab_size)
        ratios = np.asarray(gradient_ratios(head, h, jnp.asarray(targets))).reshape(-1)
        argmaxes = np.unique(log_probs.argmax(axis=-1))
        row["unargmaxable_seen_as_argmax"] = int(np.isin(unargmaxable, argmaxes).sum())
        row["distinct_argmaxes"] = int(argmaxes.size)
        row["hidden_size_estimate"] = bn.estimate_hidden_size(jnp.asarray(log_probs))
        row["gradient_ratio_median"] = float(np.median(ratios))
        row["positions"] = int(log_probs.shape[0])
    if "test_nll" in measurements:
        row["test_nll_by_train_count"] = nll_by_train_count(
            model, np.asarray(corpus.test), counts, config.data.bptt
        )
    if "train_nll" in measurements:
        row["train_nll_by_train_count"] = nll_by_train_count(
            model, np.asarray(corpus.train), counts, config.data.bptt,
            positions=train_tokens, flag="--train_tokens",
        )  # fmt: skip
    return {**row, "commit": code_commit()}


def filled(earlier: dict[str, Any], config: Config, run_dir: str) -> dict[str, Any]:
    """``earlier`` (a run's row) with the measurements it lacks added, each recorded in
    ``filled`` with the commit that measured it; unchanged if it lacks none."""
    missing = tuple(
        name for name, fields in MEASUREMENTS.items() if any(f not in earlier for f in fields)
    )
    if not missing:
        return earlier
    new = measure_run(run_dir, config.tokens, config.train_tokens, missing)
    added = {f: new[f] for name in missing for f in MEASUREMENTS[name]}
    return {
        **earlier,
        **added,
        "filled": {**earlier.get("filled", {}), **dict.fromkeys(missing, new["commit"])},
    }


def _pair_key(row: dict[str, Any]) -> tuple[int, int, int]:
    """What a head's row shares with the softmax row it is compared with."""
    return row["d"], row["seed"], row["vocab_size"]


def _groups(row: dict[str, Any], key: str) -> dict[str, dict[str, Any]] | None:
    """A row's NLL groups ``key`` (one of :data:`COUNT_SECTIONS`), or None if not measured."""
    if key != "generalization_gap":
        return row.get(key)
    test, train = row.get("test_nll_by_train_count"), row.get("train_nll_by_train_count")
    if test is None or train is None:
        return None
    return {
        name: {
            "nll": None if None in (group["nll"], train[name]["nll"])
            else group["nll"] - train[name]["nll"],
            "positions": group["positions"], "train_positions": train[name]["positions"],
        }
        for name, group in test.items()
    }  # fmt: skip


#: What must match for a head's groups to be compared with softmax's: the same test positions
#: (and training positions, for the generalization gap).
_POSITIONS = ("positions", "train_positions")


def _softmax_pairs(
    rows: list[dict[str, Any]], key: str = "test_nll_by_train_count"
) -> list[tuple[dict[str, Any], dict[str, Any], dict | None]]:
    """The rows measured by training count (``key``), each with its groups and softmax's at
    the same d, seed and vocabulary on the same positions (None for softmax's own rows and
    unpaired ones)."""
    measured = [(row, groups) for row in rows if (groups := _groups(row, key)) is not None]
    softmax = {_pair_key(row): groups for row, groups in measured if row["head"] == "softmax"}
    pairs = []
    for row, groups in measured:
        base = softmax.get(_pair_key(row)) if row["head"] != "softmax" else None
        if base is not None and any(
            base[g].get(n) != groups[g].get(n) for g in groups for n in _POSITIONS
        ):
            base = None  # other windows: not comparable group by group
        pairs.append((row, groups, base))
    return pairs


#: The sections of :func:`count_table`: the groups' key and what the section says of them.
COUNT_SECTIONS = {
    "test_nll_by_train_count": (
        "Test NLL by the target word's training count",
        "Mean NLL (nats) over the test set's whole windows, grouped by how often the target "
        "word occurs in the training data",
    ),
    "train_nll_by_train_count": (
        "Training NLL by the target word's training count",
        "The same over the first whole windows of the training stream (`--train_tokens`, no "
        "dropout): how well each run fits the words it was trained on",
    ),
    "generalization_gap": (
        "Generalization gap by the target word's training count",
        "Test NLL minus training NLL, group by group: a head whose bracket here is positive "
        "while its training bracket is negative fits those words better than softmax and "
        "generalizes worse",
    ),
}


def count_table(rows: list[dict[str, Any]]) -> str:
    """The rows' NLL by training count as Markdown sections (:data:`COUNT_SECTIONS`: test,
    training, their difference): each group's mean NLL and, in brackets, minus softmax's where
    ``rows`` hold softmax's run at the same d, seed and vocabulary (on the same positions). A
    section no row has is left out; empty if none."""
    sections = []
    for key, (heading, what) in COUNT_SECTIONS.items():
        pairs = _softmax_pairs(rows, key)
        if not pairs:
            continue
        cells = []
        for row, groups, base in pairs:
            line = {"run": row["run"]}
            for name, group in groups.items():
                line[name] = None if group["nll"] is None else f"{group['nll']:.3f}"
                if line[name] and base is not None and base[name]["nll"] is not None:
                    line[name] += f" ({group['nll'] - base[name]['nll']:+.3f})"
            cells.append(line)
        counts = "; ".join(dict.fromkeys(  # each distinct grouping once, in order
            f"vocabulary {row['vocab_size']:,}: " + ", ".join(
                f"{name}: {group['positions']:,}" for name, group in groups.items()
            )
            for row, groups, _ in pairs
        ))  # fmt: skip
        sections.append(
            f"## {heading}\n\n{what}; in brackets, minus softmax's at the same d and seed "
            f"(negative: the head does better there). Positions per group ({counts}).\n\n"
            + markdown_table(cells)
        )
    return "\n\n".join(sections)


def count_gaps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each head's gap to softmax in test NLL, split over the training-count groups.

    Group ``g`` of a head paired with softmax's run (same d, seed, vocabulary and positions)
    gives ``n_g (nll_g - nll_g^softmax) / n`` nats, ``n_g`` of the ``n`` positions being in it,
    so a head's groups sum to its gap in the whole test NLL. Returns one entry per head, d and
    group: the mean over the seeds paired (``gap_nats``) and their number (``seeds``).
    """
    per_group: dict[tuple[str, int, str], list[float]] = {}
    for row, groups, base in _softmax_pairs(rows):
        if base is None:
            continue
        for name, group in groups.items():
            if name == "all" or group["nll"] is None:  # an empty group adds nothing
                continue
            share = group["positions"] / groups["all"]["positions"]
            gap = share * (group["nll"] - base[name]["nll"])
            per_group.setdefault((row["head"], row["d"], name), []).append(gap)
    return [
        {"head": head, "d": d, "group": name, "gap_nats": float(np.mean(gaps)), "seeds": len(gaps)}
        for (head, d, name), gaps in per_group.items()
    ]


def plot_count_gaps(gaps: list[dict[str, Any]], path: Path) -> None:
    """One panel per d: bars of :func:`count_gaps` per training-count group, a colour per head
    (above 0: worse than softmax on those words)."""
    ds = sorted({entry["d"] for entry in gaps})
    heads = list(dict.fromkeys(entry["head"] for entry in gaps))
    groups = list(dict.fromkeys(entry["group"] for entry in gaps))
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(ds), figsize=(1.5 + 4.5 * len(ds), 4), sharey=True, squeeze=False
    )
    width = 0.8 / len(heads)
    for axis, d in zip(axes[0], ds, strict=True):
        for i, head in enumerate(heads):
            gap = {e["group"]: e["gap_nats"] for e in gaps if e["d"] == d and e["head"] == head}
            offset = (i - (len(heads) - 1) / 2) * width
            xs = [j + offset for j in range(len(groups))]
            axis.bar(xs, [gap.get(g, np.nan) for g in groups], width, color=f"C{i}", label=head)
        axis.axhline(0.0, color="0.3", lw=1)
        axis.set_xticks(range(len(groups)), groups)
        axis.set_xlabel("the target word's count in training")
        axis.set_title(f"d = {d}")
        axis.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(
        "test NLL minus softmax's (nats)\nper group; a head's bars sum to its gap"
    )
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def earlier_rows(
    out: Path, flag: str = "--merge", must_exist: bool = False
) -> list[dict[str, Any]]:
    """The rows ``out`` holds from earlier calls (none if it does not exist yet, unless
    ``must_exist``); a file that is not such rows is a usage error naming ``flag``."""
    if not out.exists():
        if must_exist:
            raise UsageError(f"{flag}: {out} does not exist")
        return []
    try:
        rows = json.loads(out.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"{flag}: {out} is not JSON ({error})") from None
    if not (isinstance(rows, list) and all(isinstance(r, dict) and "run" in r for r in rows)):
        raise UsageError(f"{flag}: {out} is not a list of this script's rows (each with 'run')")
    return rows


def write_rows(rows: list[dict[str, Any]], out: Path, merge: bool) -> None:
    """``rows`` to ``out`` (JSON), its page (``.md``) and its plot (``.png``, removed where no
    head is paired with softmax: an earlier call's plot would not be these rows')."""
    store.write_json(out, rows, indent=1)
    out.with_suffix(".md").write_text(results_page(PAGE_TITLE, page_body(rows, merge)))
    gaps = count_gaps(rows)
    if gaps:
        plot_count_gaps(gaps, out.with_suffix(".png"))
    else:
        out.with_suffix(".png").unlink(missing_ok=True)


def page_body(rows: list[dict[str, Any]], merge: bool) -> str:
    """The results page under its header: the rows' table, then the NLL by training count
    (``merge``: first the note that the rows were gathered call by call)."""
    table = markdown_table(rows, TABLE_COLUMNS, floatfmt=".3g")
    table = f"{table}\n\n{count_table(rows)}"
    return f"{MERGED_NOTE}\n\n{table}" if merge else table


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    config = parse_config(Config, argv=argv)
    out = Path(config.out or Path(config.run_dirs[0]) / "consequences.json")
    with one_line_errors(config):
        rows = earlier_rows(out) if config.merge else []
        for path in config.merge_from:
            for row in earlier_rows(Path(path), "--merge_from", must_exist=True):
                rows = store.upsert(rows, row, key=lambda r: r["run"])
        if config.merge_from:
            write_rows(rows, out, config.merge)
        for run_dir in progress(config.run_dirs, desc="runs"):
            earlier = {row["run"]: row for row in rows}.get(Path(run_dir).name)
            if config.fill_missing and earlier is not None:
                row = filled(earlier, config, run_dir)
            else:
                row = measure_run(run_dir, config.tokens, config.train_tokens)
            rows = store.upsert(rows, row, key=lambda r: r["run"])
            # Both files after each run (minutes each): an interrupted call keeps the rows it
            # measured, and the table always shows the JSON's rows, no more.
            write_rows(rows, out, config.merge)
    print(page_body(rows, merge=False))
    plot = f", {out.with_suffix('.png').name}" if count_gaps(rows) else ""
    print(f"wrote {out}{plot} and {out.with_suffix('.md').name}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
