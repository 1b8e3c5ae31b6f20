"""The study's report, written from its rows (:mod:`bottleneck.runs.lm_study`'s results CSV or
its finished cells): per d, softmax's perplexity and each head's paired gain with its 95%
interval, Holm-corrected p and wins; the design's power; each head's trend in log d; the cost;
the tuned arm and the convergence probe; the published gains (``published_ptb.json``, each
named by its table and row); the plots.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bottleneck.runs.cli import markdown_table, pyplot
from bottleneck.runs.folder import RunDir
from bottleneck.runs.lm_study import (
    CONVERGED_IMPROVEMENT,
    Config,
    cell_name,
    main_dropout,
    read_results_csv,
)
from bottleneck.runs.statistics import (
    ALPHA,
    POWER,
    detectable_gain,
    gain_trend,
    holm,
    paired_t,
    seeds_needed,
)

if TYPE_CHECKING:
    import jinja2


def main_device(rows: list[dict[str, Any]]) -> str:
    """The device most finished cells trained on: the one whose seconds the report compares."""
    devices = [r["device"] for r in rows if r["status"] == "done"]
    return max(devices, key=devices.count, default="")


def summarize(rows: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Mean +- std over seeds per head x d, and the gain over softmax at the same d, paired by
    seed, with its interval and p-value (:func:`_paired_gains`) and the p-value adjusted by
    Holm over all the grid's comparisons (``p_holm``); seconds (s/epoch, the cost over
    softmax) only of the cells trained on :func:`main_device`."""
    done = [r for r in rows if r["status"] == "done"]
    device = main_device(rows)
    table = []
    for d in config.ds:
        base = {r["seed"]: r for r in done if r["head"] == "softmax" and r["d"] == d}
        timed_base = {s: r for s, r in base.items() if r["device"] == device}
        for head in config.heads:
            cells = [r for r in done if r["head"] == head and r["d"] == d]
            if not cells:
                continue
            timed = [r for r in cells if r["device"] == device]
            test = np.array([r["test_ppl"] for r in cells])
            valid = np.array([r["valid_ppl"] for r in cells])
            entry = {
                "d": d,
                "head": head,
                "seeds": len(cells),
                "test_ppl": float(test.mean()),
                "test_std": float(test.std(ddof=1)) if len(cells) > 1 else None,
                "valid_ppl": float(valid.mean()),
                "epochs": float(np.mean([r["epochs"] for r in cells])),
                "early_stopped": sum(r["stop_reason"].startswith("early") for r in cells),
                "converged": sum(bool(r["converged"]) for r in cells),
                "s_per_epoch": (
                    float(np.median([r["seconds_per_epoch"] for r in timed])) if timed else None
                ),
                "params": cells[0]["params"],
            }
            if head != "softmax":
                entry.update(_paired_gains(cells, base))
                entry.update(_paired_cost(timed, timed_base))
            table.append(entry)
    _holm_over(table)
    return table


def _paired_gains(cells: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The gain over softmax seed by seed, over the seeds where both finished (the heads of one
    seed share its data order and initial trunk): its mean in perplexity and in %, the per-seed
    gains in % (and their seeds), their spread (``None`` below two seeds), the paired t
    interval and p-value of :func:`paired_t` (``None`` below two seeds), how many seeds the
    head beats softmax in (``base``: softmax's rows at the same d, by seed), and the seeds whose
    head and softmax cells trained on different devices (``cross_device_seeds``); where there
    are such seeds, the same statistics over the others (``same_device``). Empty if no seed has
    both. A seed of the head alone counts in its mean perplexity, not in its gain: compared
    with softmax's other seeds, the seeds' own spread would pass for a head's gain."""
    paired = sorted((r for r in cells if r["seed"] in base), key=lambda r: r["seed"])
    if not paired:
        return {}
    gains = [_gain_pct(base[r["seed"]], r) for r in paired]
    crossing = [r["seed"] for r in paired if r["device"] != base[r["seed"]]["device"]]
    entry = {
        "gain_ppl": float(np.mean([base[r["seed"]]["test_ppl"] - r["test_ppl"] for r in paired])),
        **_gain_stats(gains),
        "seed_gains_pct": gains,
        "gain_seeds": [r["seed"] for r in paired],
        "cross_device_seeds": crossing,
    }
    if crossing:
        kept = [g for r, g in zip(paired, gains, strict=True) if r["seed"] not in crossing]
        entry["same_device"] = _gain_stats(kept) if kept else None
    return entry


def _gain_pct(softmax: dict[str, Any], cell: dict[str, Any]) -> float:
    return float(100.0 * (softmax["test_ppl"] - cell["test_ppl"]) / softmax["test_ppl"])


def _gain_stats(gains: list[float]) -> dict[str, Any]:
    """Mean, spread, interval, p-value and wins of per-seed gains in % (:func:`paired_t`)."""
    t = paired_t(gains)
    return {
        "gain_pct": float(np.mean(gains)),
        "gain_pct_std": None if t is None else t["std"],
        "gain_ci": None if t is None else (t["ci_low"], t["ci_high"]),
        "p_value": None if t is None else t["p"],
        "better_seeds": sum(g > 0 for g in gains),
        "paired_seeds": len(gains),
    }


def _holm_over(table: list[dict[str, Any]]) -> None:
    """Sets ``p_holm`` on every entry with a p-value: Holm over all of them (one family: the
    grid's head x d comparisons, or a column of the tuned arm), and ``comparisons``, their
    number."""
    tested = [e for e in table if e.get("p_value") is not None]
    for e, p in zip(tested, holm([e["p_value"] for e in tested]), strict=True):
        e["p_holm"], e["comparisons"] = p, len(tested)


def _paired_cost(cells: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The head's seconds per epoch over softmax's, seed by seed (a seed's cells usually run on
    one machine, so its ratio cancels the machine's speed, which the seeds' seconds may not share):
    the median over the seeds where both finished, and the smallest and largest. Empty if no
    seed has both."""
    ratios = [
        r["seconds_per_epoch"] / base[r["seed"]]["seconds_per_epoch"]
        for r in cells
        if r["seed"] in base
    ]
    if not ratios:
        return {}
    return {
        "time_ratio": float(np.median(ratios)),
        "time_ratio_min": float(min(ratios)),
        "time_ratio_max": float(max(ratios)),
    }


def title(config: Config, rows: list[dict[str, Any]]) -> str:
    """The results page's title, ending in "partial" while cells are pending."""
    trunk = config.trunk
    partial = " — partial" if any(r["status"] == "pending" for r in rows) else ""
    fixed = " (fixed trunk: decoder E Q)" if config.embedding == "fixed" else ""
    return (
        f"LM study: {trunk.model.family}{fixed} on {trunk.data.corpus} "
        f"({trunk.data.vocab_size or 'all'} words), heads x d x seeds {list(config.seeds)}{partial}"
    )


def trained_seconds(rows: list[dict[str, Any]]) -> float:
    """The finished cells' training seconds in all (their epochs', not evaluation's)."""
    return sum(r["train_seconds"] for r in rows if r["status"] == "done")


def markdown(
    table: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    config: Config,
    ranks: Sequence[dict[str, Any]] = (),
) -> str:
    """The results page's body, rendered from the template lm_study_report.md.j2 (the prose)
    with the numbers and the tables' rows computed here: the grid, the table of heads x d, the
    gains' statistics, the design's power, the trend with d, the device crossings, the cost,
    the tuned arm, the convergence probe, the compute, the pending cells and the ranks."""
    done = [r for r in rows if r["status"] == "done"]
    tested = [e for e in table if e.get("p_value") is not None]
    budget_ended = [r for r in done if not r["stop_reason"].startswith("early")]
    device = main_device(rows)
    tuned = tuned_arm(config, rows) if config.tuned_csvs else []
    probe = convergence_probe(config, rows, table) if config.probe_csv is not None else []
    decimals = _decimals(table)
    page = _template().render(
        config=config,
        trunk=config.trunk,
        head=config.trunk.head,
        any_head=lambda *names: any(name in config.heads for name in names),
        rows=rows,
        done=done,
        tested=tested,
        softmax=sorted((e for e in table if e["head"] == "softmax"), key=lambda e: e["d"]),
        budget_ended=budget_ended,
        still_improving=[r for r in budget_ended if _last_epoch_improved(r)],
        summary_rows=[_table_row(e, decimals) for e in table],
        stats_rows=[_stats_row(e) for e in tested],
        grid=gains_by_d(table, config, decimals),
        published=PUBLISHED_PTB if _published_applies(config) else {},
        power_rows=_power_rows(tested) if tested else [],
        trend_rows=[_trend_row(t) for t in gain_trends(table, config)] if tested else [],
        crossing_rows=[_crossing_row(e) for e in tested if e["cross_device_seeds"]],
        costs=costs_by_d(table, config),
        tuned_d=tuned[0]["d"] if tuned else None,
        tuned_rows=_tuned_rows(tuned),
        tuned_pending=_tuned_pending(tuned),
        probe_rows=[_probe_row(e) for e in probe],
        device=device,
        compute=_hours_by_device(done, device),
        elsewhere=[r for r in done if r["device"] != device],
        pending=[r for r in rows if r["status"] == "pending"],
        failed=[r for r in rows if r["status"] == "failed"],
        ranks=ranks,
        rank_rows=[
            {
                "head": r["head"],
                "numerical rank": r["numerical_rank"],
                "effective rank (99%)": r["effective_rank"],
            }
            for r in ranks
        ],
        confidence=f"{1 - ALPHA:.0%}",
        alpha=ALPHA,
        power=f"{POWER:.0%}",
        converged_improvement=CONVERGED_IMPROVEMENT,
    )
    return _reflow(page)


@functools.cache
def _template() -> jinja2.Template:
    import jinja2  # here, not at import: the study script starts without it (as without pyplot)

    environment = jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )
    environment.filters["fmt"] = format
    environment.filters["cell"] = lambda row: cell_name(row["head"], row["d"], row["seed"])
    environment.globals["table"] = markdown_table
    template = Path(__file__).with_name("lm_study_report.md.j2").read_text("utf-8")
    return environment.from_string(template)


def _reflow(page: str) -> str:
    """The rendered template with each paragraph on one line (its whitespace runs made single
    spaces), the paragraphs one blank line apart; tables and lists as they are."""
    blocks = [block.strip("\n") for block in re.split(r"\n\s*\n", page) if block.strip()]
    return (
        "\n\n".join(
            block if block.startswith(("|", "- ")) else " ".join(block.split()) for block in blocks
        )
        + "\n"
    )


def _recipe_setting(config: Config) -> tuple[float, float]:
    """The grid's one recipe: its trunk's (peak lr, dropout)."""
    return config.trunk.optimizer.lr, main_dropout(config.trunk.model)


def _setting(row: dict[str, Any], config: Config) -> tuple[float, float]:
    """A row's (peak lr, dropout); a row of before those columns has its CSV's recipe, which
    for --results_csv is this config's trunk."""
    if row.get("lr") is None:
        return _recipe_setting(config)
    return row["lr"], row["dropout"]


def _setting_text(setting: tuple[float, float]) -> str:
    return f"lr {setting[0]:g}, dropout {setting[1]:g}"


def tuned_arm(config: Config, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tuned arm: per head, the setting (one CSV of ``--tuned_csvs``, or the grid's
    ``rows`` for the recipe) of the lowest validation perplexity at the first of
    ``--tuned_seeds``, then that setting's cells of those seeds against softmax's at softmax's
    own choice, paired by seed (:func:`_paired_gains`), and the one-recipe gain over the same
    seeds beside it. The arm's d is the largest of the tuned CSVs'; one entry per head with a
    cell there, in the order of ``--heads``. ``pending_settings``: the arm's settings (those
    any of its cells has) not recorded at the head's first seed, so that its choice may still
    change; ``pending_seeds``: the arm's seeds not recorded at its choice.

    A setting's rows are read from its CSV whatever their config digest: the CSV holds one
    setting, and each row says its own (``lr``, ``dropout``). A tuned CSV may hold the recipe's
    setting (cells retrained on the device of the arm's other settings): its cells take the
    place of the grid's, in the choice and in the recipe's gain. ``choice_devices``: the
    devices the first seed's cells that a head's choice compares trained on (more than one:
    the choice compares devices too); the tuned gain's ``cross_device_seeds`` as in the grid's
    table. Each tuned and each recipe gain with a p-value has ``p_holm``: Holm over the arm's
    gains of that kind (one family a column)."""
    tuned = [row for path in config.tuned_csvs for row in read_results_csv(Path(path)).values()]
    if not tuned:
        return []
    d, seeds = max(r["d"] for r in tuned), set(config.tuned_seeds)
    first_seed = min(seeds)
    arms: dict[tuple[float, float], dict[tuple[str, int], dict[str, Any]]] = {}
    for row in (*(r for r in rows if r["status"] == "done"), *tuned):
        if row["d"] == d and row["seed"] in seeds:
            arms.setdefault(_setting(row, config), {})[(row["head"], row["seed"])] = row
    recipe = arms.get(_recipe_setting(config), {})
    entries, chosen_cells = [], {}
    for head in config.heads:
        first = {
            s: cells[(head, first_seed)] for s, cells in arms.items() if (head, first_seed) in cells
        }
        if not first:
            continue
        chosen = min(first, key=lambda s: first[s]["valid_ppl"])
        cells = [arms[chosen][(head, s)] for s in sorted(seeds) if (head, s) in arms[chosen]]
        chosen_cells[head] = cells
        entries.append({
            "head": head, "d": d, "setting": chosen, "seeds": [r["seed"] for r in cells],
            "first_seed_valid": {s: first[s]["valid_ppl"] for s in sorted(first)},
            "pending_settings": sorted(set(arms) - set(first)),
            "pending_seeds": [s for s in sorted(seeds) if (head, s) not in arms[chosen]],
            "choice_devices": sorted({first[s]["device"] for s in first}),
            "test_ppl": float(np.mean([r["test_ppl"] for r in cells])),
        })  # fmt: skip
    base = {r["seed"]: r for r in chosen_cells.get("softmax", [])}
    for e in entries:
        if e["head"] == "softmax":
            continue
        e["tuned"] = _paired_gains(chosen_cells[e["head"]], base)
        paired = e["tuned"].get("gain_seeds", [])
        if all((h, s) in recipe for h in ("softmax", e["head"]) for s in paired) and paired:
            e["recipe"] = _paired_gains(
                [recipe[(e["head"], s)] for s in paired],
                {s: recipe[("softmax", s)] for s in paired},
            )
    for arm in ("tuned", "recipe"):
        _holm_over([e[arm] for e in entries if e.get(arm)])
    return entries


def _tuned_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tuned arm's table: a head's choice, each setting's first-seed validation, its seeds'
    test perplexity and its gains, tuned and in the recipe."""
    settings = sorted({s for e in entries for s in e["first_seed_valid"]})
    table = []
    for e in entries:
        row = {"head": e["head"], "chosen": _setting_text(e["setting"])}
        if e["pending_settings"]:
            tried = len(e["first_seed_valid"])
            row["chosen"] += f" (so far: {tried} of {tried + len(e['pending_settings'])})"
        for s in settings:
            valid = e["first_seed_valid"].get(s)
            row[_setting_text(s)] = "—" if valid is None else f"{valid:.2f}"
        row["seeds"] = " ".join(map(str, e["seeds"]))
        row["test ppl"] = f"{e['test_ppl']:.2f}"
        for arm in ("tuned", "recipe"):
            stats_ = e.get(arm) or {}
            row[f"gain, {arm} (%)"] = (
                "—" if not stats_ else
                f"{stats_['gain_pct']:+.2f} {_interval_text(stats_['gain_ci'])}"
            )  # fmt: skip
            p = stats_.get("p_holm")
            row[f"p (Holm), {arm}"] = "—" if p is None else f"{p:.3f}"
        row["devices"] = _tuned_devices_text(e)
        table.append(row)
    return table


def _tuned_pending(entries: list[dict[str, Any]]) -> list[str]:
    """Per head, the tuned arm's cells not recorded yet: its first seed at the settings it
    lacks, then the arm's other seeds at its choice."""
    pending = []
    for e in entries:
        parts = [  # the choice holds the first seed's cell, so e["seeds"][0] is that seed
            f"seed {e['seeds'][0]} at " + " and at ".join(map(_setting_text, e["pending_settings"]))
        ] if e["pending_settings"] else []  # fmt: skip
        if later := e["pending_seeds"]:
            where = "its choice" if e["pending_settings"] else _setting_text(e["setting"])
            parts.append(f"seed{'s' if len(later) > 1 else ''} {_seeds_text(later)} at {where}")
        if parts:
            pending.append(f"{e['head']}: " + ", then ".join(parts))
    return pending


def _seeds_text(seeds: list[int]) -> str:
    return ", ".join(map(str, seeds[:-1])) + " and " * (len(seeds) > 1) + str(seeds[-1])


def _tuned_devices_text(e: dict[str, Any]) -> str:
    """'same', or what crosses devices: the settings compared for the choice, the tuned pairs."""
    parts = []
    if len(e["choice_devices"]) > 1:
        parts.append("choice across " + " and ".join(e["choice_devices"]))
    if crossing := _crossing_text(e.get("tuned") or {}):
        parts.append(crossing)
    return "; ".join(parts) or "same"


def convergence_probe(
    config: Config, rows: list[dict[str, Any]], table: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each cell of ``--probe_csv`` (a longer budget) beside this grid's cell of the same head,
    d and seed: the change of test perplexity in %, and the half-width of the gain interval it
    is to be read against (at that d: the head's own, or for softmax the widest of the probed
    heads')."""
    probed = read_results_csv(Path(config.probe_csv)).values()
    grid = {(r["head"], r["d"], r["seed"]): r for r in rows if r["status"] == "done"}
    gains = {(e["head"], e["d"]): e for e in table if e.get("gain_ci") is not None}
    entries = []
    for p in sorted(probed, key=lambda r: (r["d"], r["head"] != "softmax", r["head"])):
        cell = grid.get((p["head"], p["d"], p["seed"]))
        if cell is None:
            continue
        heads = [p["head"]] if p["head"] != "softmax" else [
            q["head"] for q in probed if q["d"] == p["d"] and q["head"] != "softmax"
        ]  # fmt: skip
        widths = [_half_width(gains[(h, p["d"])]) for h in heads if (h, p["d"]) in gains]
        entries.append({
            "head": p["head"], "d": p["d"], "seed": p["seed"],
            "epochs": (cell["epochs"], p["epochs"]),
            "test_ppl": (cell["test_ppl"], p["test_ppl"]),
            "change_pct": 100.0 * (p["test_ppl"] - cell["test_ppl"]) / cell["test_ppl"],
            "half_width": max(widths) if widths else None,
            "same_device": p["device"] == cell["device"],
        })  # fmt: skip
    return entries


def _half_width(e: dict[str, Any]) -> float:
    low, high = e["gain_ci"]
    return (high - low) / 2


def _probe_row(e: dict[str, Any]) -> dict[str, Any]:
    return {
        "d": e["d"],
        "head": e["head"],
        "seed": e["seed"],
        "epochs (grid → probe)": f"{e['epochs'][0]} → {e['epochs'][1]}",
        "test ppl (grid → probe)": f"{e['test_ppl'][0]:.2f} → {e['test_ppl'][1]:.2f}",
        "change (%)": f"{e['change_pct']:+.2f}",
        "gain's half-width (%)": "—" if e["half_width"] is None else f"{e['half_width']:.2f}",
        "within": (
            "—" if e["half_width"] is None
            else "yes" if abs(e["change_pct"]) < e["half_width"] else "no"
        ),
        "device": "same" if e["same_device"] else "differs",
    }  # fmt: skip


def _last_epoch_improved(row: dict[str, Any]) -> bool:
    curve = [float(v) for v in row["valid_curve"].split()]
    return len(curve) >= 2 and curve[-1] < min(curve[:-1])


def _interval_text(ci: tuple[float, float] | None) -> str:
    return "—" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _reading(e: dict[str, Any]) -> str:
    """'no detectable difference' where the interval spans 0, else a gain or loss (and whether
    it holds after Holm)."""
    low, high = e["gain_ci"]
    if low <= 0 <= high:
        return "no detectable difference"
    word = "gain" if low > 0 else "loss"
    return f"{word}, after Holm" if e["p_holm"] < ALPHA else f"{word}, not after Holm"


def _stats_row(e: dict[str, Any]) -> dict[str, Any]:
    return {
        "d": e["d"],
        "head": e["head"],
        "gain (%)": _gain_pct_text(e),
        f"{1 - ALPHA:.0%} CI": _interval_text(e["gain_ci"]),
        "p": f"{e['p_value']:.3f}",
        "p (Holm)": f"{e['p_holm']:.3f}",
        "better in": _better_in_text(e),
        "reading": _reading(e),
        "devices": _crossing_text(e) or "same",
    }


def _crossing_text(e: dict[str, Any]) -> str:
    seeds = e.get("cross_device_seeds") or []
    return ", ".join(f"seed {s} crosses" for s in seeds)


def _crossing_row(e: dict[str, Any]) -> dict[str, Any]:
    kept = e["same_device"]
    return {
        "d": e["d"],
        "head": e["head"],
        "crossing": ", ".join(f"seed {s}" for s in e["cross_device_seeds"]),
        "gain, every seed (%)": f"{e['gain_pct']:+.2f} {_interval_text(e['gain_ci'])}",
        "without them (%)": (
            "—" if kept is None else f"{kept['gain_pct']:+.2f} {_interval_text(kept['gain_ci'])}"
        ),
        "better in, without": "—" if kept is None else _better_in_text(kept),
    }


def design_spreads(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-seed spread of the gains that the design's power is judged by: the median of
    the comparisons' spreads, their pooled value (root mean square) and the pooled value at each
    d, each with the number of comparisons and of seeds a comparison has (the smallest)."""
    tested = [e for e in table if e.get("gain_pct_std") is not None]
    groups = [("median over all comparisons", tested, "median")]
    groups.append(("pooled over all comparisons", tested, "pooled"))
    for d in sorted({e["d"] for e in tested}):
        groups.append((f"pooled at d = {d}", [e for e in tested if e["d"] == d], "pooled"))
    spreads = []
    for name, entries, how in groups:
        stds = np.array([e["gain_pct_std"] for e in entries])
        spread = np.median(stds) if how == "median" else np.sqrt(np.mean(stds**2))
        spreads.append(
            {
                "spread": name,
                "value": float(spread),
                "comparisons": len(entries),
                "seeds": min(e["paired_seeds"] for e in entries),
            }
        )
    return spreads


def _power_rows(tested: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The design's power at each of :func:`design_spreads`: the gain detectable at its seeds,
    the seeds needed for a gain of 1 point."""
    return [
        {
            "spread of the per-seed gains": s["spread"],
            "points of %": f"{s['value']:.2f}",
            "seeds (n)": s["seeds"],
            # No spread at all (identical gains): nothing to size a test with.
            f"detectable with {POWER:.0%} power at n": (
                f"{detectable_gain(s['value'], s['seeds']):.2f}" if s["value"] > 0 else "—"
            ),
            f"seeds for {POWER:.0%} power at 1 point": (
                str(seeds_needed(1.0, s["value"])) if s["value"] > 0 else "—"
            ),
        }
        for s in design_spreads(tested)
    ]


def gain_trends(table: list[dict[str, Any]], config: Config) -> list[dict[str, Any]]:
    """Each head's :func:`gain_trend` over its paired cells (d, seed), the seeds as the
    replicates, with its p-value corrected by Holm over the heads' trends (``p_holm``); heads
    with fewer than two seeds at two or more d are left out."""
    trends = []
    for head in config.heads:
        entries = [e for e in table if e["head"] == head and "seed_gains_pct" in e]
        trend = gain_trend(
            [e["d"] for e in entries for _ in e["seed_gains_pct"]],
            [g for e in entries for g in e["seed_gains_pct"]],
            [s for e in entries for s in e["gain_seeds"]],
        )
        if trend is not None:
            trends.append({"head": head, **trend})
    for trend, corrected in zip(trends, holm([t["p"] for t in trends]), strict=True):
        trend["p_holm"] = corrected
    return trends


def _trend_row(t: dict[str, Any]) -> dict[str, Any]:
    return {
        "head": t["head"],
        "gain per doubling of d (points of %)": f"{t['slope']:+.2f}",
        f"{1 - ALPHA:.0%} CI": _interval_text((t["ci_low"], t["ci_high"])),
        "p": f"{t['p']:.3f}",
        "p (Holm)": f"{t['p_holm']:.3f}",
        "seeds": t["seeds"],
    }


def _hours_by_device(done: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """The finished cells' training hours and count per device, ``device`` (whose seconds alone
    the s/epoch column and the cost grid compare) first, then the others by name."""
    devices = sorted({r["device"] for r in done}, key=lambda dev: (dev != device, dev))
    by_device = {dev: [r for r in done if r["device"] == dev] for dev in devices}
    return [
        {"device": dev, "hours": trained_seconds(cells) / 3600, "cells": len(cells)}
        for dev, cells in by_device.items()
    ]


def gains_by_d(table: list[dict[str, Any]], config: Config, decimals: int) -> list[dict[str, str]]:
    """The summary as a head x d grid, short enough for a README: softmax's test perplexity,
    then each head's mean paired gain over it in %, its paired 95% interval (with two or more
    seeds), the seeds it wins in, and † where a seed's pair crosses devices ("—" where no seed
    is paired, blank where no cell); a head or d with no cell at all has no row or column. For
    a study of PTB's 10,000 words, a last column gives the head's published gain there against
    the softmax it was published beside (:data:`PUBLISHED_PTB`)."""
    entries, heads, ds, published = _grid_axes(table, config)
    grid = []
    for head in heads:
        cells = {"head": f"{head} (test ppl)" if head == "softmax" else head}
        for d in ds:
            e = entries.get((head, d))
            if e is None:
                text = ""
            elif head == "softmax":
                text = _test_ppl_text(e, decimals)
            elif "gain_pct" in e:
                interval = "" if e["gain_ci"] is None else f" {_interval_text(e['gain_ci'])}"
                crossing = "†" if e["cross_device_seeds"] else ""
                text = f"{e['gain_pct']:+.2f}{interval} ({_better_in_text(e)}){crossing}"
            else:
                text = "—"
            cells[f"d = {d}"] = text
        if published:
            if head == "softmax":
                cells["published (PTB)"] = _published_softmax_text()
            else:
                cells["published (PTB)"] = (
                    PUBLISHED_PTB[head].text() if head in PUBLISHED_PTB else "—"
                )
        grid.append(cells)
    return grid


def _grid_axes(
    table: list[dict[str, Any]], config: Config
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[str], list[int], bool]:
    """What a head x d grid of the summary shows: its entries by (head, d), the heads and the
    d's that have a cell (in the config's order), and whether :data:`PUBLISHED_PTB`'s column
    applies (:func:`_published_applies`)."""
    entries = {(e["head"], e["d"]): e for e in table}
    heads = [h for h in config.heads if h in {h_ for h_, _ in entries}]
    ds = [d for d in config.ds if d in {d_ for _, d_ in entries}]
    return entries, heads, ds, _published_applies(config)


def _published_applies(config: Config) -> bool:
    """Whether the study is PTB's 10,000 words, where the published gains compare."""
    return config.trunk.data.corpus == "ptb" and config.trunk.data.vocab_size is None


def costs_by_d(table: list[dict[str, Any]], config: Config) -> list[dict[str, str]]:
    """Each head's seconds per epoch over softmax's, a column per d: the median over the paired
    seeds and, with two or more, the smallest and largest ("—" where no seed is paired, blank
    where no cell); for a study of PTB's 10,000 words, a last column gives the published ratio
    where :data:`PUBLISHED_PTB` has both seconds. No softmax row, and none without a cell."""
    entries, heads, ds, published = _grid_axes(table, config)
    grid = []
    for head in (h for h in heads if h != "softmax"):
        cells = {"head": head}
        for d in ds:
            e = entries.get((head, d))
            cells[f"d = {d}"] = "" if e is None else _time_ratio_text(e)
        if published:
            result = PUBLISHED_PTB.get(head)
            cells["published (PTB)"] = (
                result.time_ratio_text(PUBLISHED_PTB["softmax"]) if result else "—"
            )
        grid.append(cells)
    return grid


def _time_ratio_text(e: dict[str, Any]) -> str:
    if "time_ratio" not in e:
        return "—"
    if e["time_ratio_min"] == e["time_ratio_max"]:
        return f"{e['time_ratio']:.2f}×"
    return f"{e['time_ratio']:.2f}× ({e['time_ratio_min']:.2f}–{e['time_ratio_max']:.2f})"


@dataclasses.dataclass(frozen=True)
class PublishedResult:
    """A head's published test perplexity on PTB (10,000 words, without finetuning) beside
    the softmax it was published against (``softmax_ppl`` is None for softmax's own row), and
    its seconds per epoch where the table gives them. ``source`` names the table and the row of
    each number; ``other_model`` marks a comparison of two different models (not one trunk
    with two heads)."""

    source: str
    head_ppl: float
    softmax_ppl: float | None = None
    seconds_per_epoch: float | None = None
    other_model: bool = False

    def text(self) -> str:
        """The published gain and the softmax it is against, as the grid's last column writes
        it (softmax's row: its perplexity)."""
        if self.softmax_ppl is None:
            return f"{self.head_ppl:g}"
        gain = 100.0 * (self.softmax_ppl - self.head_ppl) / self.softmax_ppl
        return f"{gain:+.2f}% vs {self.softmax_ppl:g}" + (
            " (other model)" if self.other_model else ""
        )

    def time_ratio_text(self, softmax: PublishedResult) -> str:
        """Its seconds per epoch over ``softmax``'s, as the cost grid writes it."""
        if self.seconds_per_epoch is None or softmax.seconds_per_epoch is None:
            return "—"
        return f"{self.seconds_per_epoch / softmax.seconds_per_epoch:.2f}×"


#: The seeds' claims (the data file published_ptb.json), for the report's last column, each
#: against the softmax it was published beside, named by table and row: AWD-LSTMs of 24-27 M
#: parameters at test perplexity ~56-59, heavily regularized and trained for hundreds of epochs,
#: whose head input is 400 wide (softmax, sigsoftmax, PLIF: the embedding size) or 280 (MoS);
#: ours have 0.6-2.1 M parameters at 110-145. Test perplexity before finetuning and dynamic
#: evaluation. Mixtape's paper (Yang et al. 2019) reports PTB, but its table is not among this
#: project's sources.
PUBLISHED_PTB: dict[str, PublishedResult] = {
    head: PublishedResult(**entry)
    for head, entry in json.loads(
        (Path(__file__).parent / "published_ptb.json").read_text("utf-8")
    ).items()
}


def _published_softmax_text() -> str:
    """Softmax's published perplexities that the gains are against, the first its own row's."""
    baselines = [PUBLISHED_PTB["softmax"].head_ppl]
    baselines += [r.softmax_ppl for r in PUBLISHED_PTB.values() if r.softmax_ppl is not None]
    return ", ".join(f"{b:g}" for b in dict.fromkeys(baselines))


def _decimals(table: list[dict[str, Any]]) -> int:
    """Decimals that give the smallest mean test perplexity four significant digits (140.8 at
    PTB's 10,000 words, 6.166 at the control's 64), so that its gains read as more than 0.0."""
    smallest = min((e["test_ppl"] for e in table), default=100.0)
    return max(1, 3 - math.floor(math.log10(smallest)))


def _table_row(e: dict[str, Any], decimals: int) -> dict[str, Any]:
    return {
        "d": e["d"],
        "head": e["head"],
        "test ppl": _test_ppl_text(e, decimals),
        "gain (ppl)": f"{e['gain_ppl']:+.{decimals}f}" if "gain_ppl" in e else "—",
        "gain (%)": _gain_pct_text(e),
        "better in": _better_in_text(e),
        "valid ppl": f"{e['valid_ppl']:.{decimals}f}",
        "epochs": round(e["epochs"], 1),
        "stopped early": f"{e['early_stopped']}/{e['seeds']}",
        "converged": f"{e['converged']}/{e['seeds']}",
        "s/epoch": "—" if e["s_per_epoch"] is None else round(e["s_per_epoch"]),
        "params": f"{e['params']:,}",
    }


def _test_ppl_text(e: dict[str, Any], decimals: int) -> str:
    std = f" ± {e['test_std']:.{decimals}f}" if e["test_std"] is not None else ""
    return f"{e['test_ppl']:.{decimals}f}{std}"


def _better_in_text(e: dict[str, Any]) -> str:
    return f"{e['better_seeds']}/{e['paired_seeds']}" if "gain_pct" in e else "—"


def _gain_pct_text(e: dict[str, Any]) -> str:
    if "gain_pct" not in e:
        return "—"
    std = f" ± {e['gain_pct_std']:.2f}" if e["gain_pct_std"] is not None else ""
    return f"{e['gain_pct']:+.2f}{std}"


def plot_vs_d(table: list[dict[str, Any]], config: Config, path: Path) -> None:
    """Test perplexity against d (left) and each head's gain over softmax at the same d (right),
    a line per head, error bars the std over seeds on the left and the paired 95% interval of
    the mean gain on the right (each seed's gain a hollow circle beside its bar). The heads sit slightly apart along d
    so that their error bars do not hide one another."""
    plt = pyplot()
    fig, (ax, gain_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {head: f"C{i}" for i, head in enumerate(config.heads)}
    for i, head in enumerate(config.heads):
        entries = [e for e in table if e["head"] == head]
        gains = [e for e in entries if "gain_pct" in e]
        # On the log2 axis a multiplicative nudge: the heads spread over about +-6% of d.
        nudge = 2.0 ** (0.16 * (i / max(len(config.heads) - 1, 1) - 0.5))
        for axis, rows, value, spread in (
            (ax, entries, "test_ppl", lambda e: e["test_std"] or 0.0),
            (gain_ax, gains, "gain_pct", _half_interval),
        ):
            if rows:
                axis.errorbar(
                    [e["d"] * nudge for e in rows],
                    [e[value] for e in rows],
                    yerr=[spread(e) for e in rows],
                    marker="o",
                    capsize=3,
                    color=colors[head],
                    label=head,
                )
        for e in gains:
            gain_ax.plot(
                [e["d"] * nudge * 1.02] * len(e["seed_gains_pct"]),  # just right of the bar
                e["seed_gains_pct"],
                ls="none",
                marker="o",
                ms=3.5,
                mfc="none",
                alpha=0.8,
                color=colors[head],
            )
    gain_ax.axhline(0.0, color="0.3", lw=1, ls="--", label="softmax")
    ax.set_ylabel("test perplexity (mean ± std over seeds)")
    ax.set_title(f"{config.trunk.data.corpus}: perplexity against the bottleneck width")
    gain_ax.set_ylabel("gain over softmax at the same d (%)")
    gain_ax.set_title(
        f"better than softmax above the line (bars: paired {1 - ALPHA:.0%} CI; circles: seeds)",
        fontsize=10,
    )
    for axis in (ax, gain_ax):
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(config.ds), [str(d) for d in config.ds])
        axis.set_xlabel("d (head input width: the bottleneck)")
        axis.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _half_interval(e: dict[str, Any]) -> float:
    """Half the width of an entry's paired interval (0 without one), for an error bar."""
    return 0.0 if e["gain_ci"] is None else (e["gain_ci"][1] - e["gain_ci"][0]) / 2


# A line style per seed, in the order of ``config.seeds`` (repeating past five); the fifth is
# dash-dot-dot, as matplotlib's (offset, on-off sequence).
SEED_LINE_STYLES = ("-", "--", ":", "-.", (0, (6, 2, 1, 2, 1, 2)))


def _seed_line_style(config: Config, seed: int) -> str | tuple:
    return SEED_LINE_STYLES[config.seeds.index(seed) % len(SEED_LINE_STYLES)]


def plot_curves(curves: dict[tuple[str, int, int], list], config: Config, path: Path) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FormatStrFormatter

    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(config.ds), figsize=(4.2 * len(config.ds), 3.8), squeeze=False, sharey=False
    )
    colors = {head: f"C{i}" for i, head in enumerate(config.heads)}
    for ax, d in zip(axes[0], config.ds, strict=True):
        ax.set_title(f"d = {d}")
        if not any(cd == d and curve for (_, cd, _), curve in curves.items()):
            ax.text(0.5, 0.5, "no cell finished yet", ha="center", va="center")
            ax.set_axis_off()
            continue
        for (head, cd, seed), curve in curves.items():
            if cd != d or not curve:
                continue
            ax.plot(
                [r["epoch"] for r in curve],
                [r["valid_ppl"] for r in curve],
                color=colors[head],
                ls=_seed_line_style(config, seed),
                marker=".",
                label=head if seed == config.seeds[0] else None,
            )
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        for set_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            set_formatter(FormatStrFormatter("%g"))  # 6.2, not 6.2 x 10^0
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation perplexity")
    # Colour is the head, line style the seed: one legend entry each.
    seed_keys = [
        Line2D([], [], color="0.3", ls=_seed_line_style(config, seed), label=f"seed {seed}")
        for seed in config.seeds
    ]
    handles, _ = axes[0][0].get_legend_handles_labels()
    axes[0][0].legend(handles=handles + seed_keys, fontsize=8)
    fig.suptitle(f"{config.trunk.data.corpus}: learning curves")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    run: RunDir,
    config: Config,
    rows: list[dict[str, Any]],
    curves: dict[tuple[str, int, int], list],
    ranks: list[dict[str, Any]],
) -> dict[str, Any]:
    """Writes the report of ``rows`` (every cell's, recorded, finished or pending) to ``run``:
    study.csv, study.md (with the ranks at ``config.rank_d``), test_ppl_vs_d.png and
    learning_curves.png; prints the summary table and returns study.json's contents."""
    table = summarize(rows, config)
    run.write_csv("study.csv", rows)
    run.write_page("study.md", title(config, rows), markdown(table, rows, config, ranks))
    plot_vs_d(table, config, run.path("test_ppl_vs_d.png"))
    plot_curves(curves, config, run.path("learning_curves.png"))
    print(markdown_table(table, ("d", "head", "test_ppl", "test_std", "gain_pct"), floatfmt=".2f"))
    return {
        "corpus": config.trunk.data.corpus,
        "cells": rows,
        "summary": table,
        "ranks": ranks,
        "train_seconds_total": trained_seconds(rows),
    }
