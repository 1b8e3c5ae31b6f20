"""experiments/lm_study.py: the smoke grids end to end (Transformer and AWD-LSTM), resuming
cells from their folders or from a results CSV, a failing cell.

The script runs in the test's process (tests/script_runs.py); its runs share one persistent JAX
compilation cache (and XLA's fast compile mode), so the cells after the first compile little.
"""

import csv
import dataclasses
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from bottleneck.runs import code_commit, parse_config
from bottleneck.runs import lm_study as study
from bottleneck.runs import lm_study_report as report
from bottleneck.runs import statistics as paired_stats
from experiments import lm_study
from tests.paths import ROOT
from tests.script_runs import run_main
from tests.usage import plain

RESULTS_CSV = ROOT / "docs" / "results" / "ptb-transformer.csv"


def _run(*args, preset="smoke"):
    return run_main(lm_study.main, preset, *args)


def _cells(out):
    return {
        (c["head"], c["d"], c["seed"]): c
        for c in json.loads((out / "study.json").read_text())["cells"]
    }


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    code, stdout, stderr = _run("--out_dir", str(out), "--results_csv", str(out / "rows.csv"))
    assert code == 0, stderr
    return out, stdout


def test_smoke_grid_writes_every_output(smoke):
    out, stdout = smoke
    for name in ("config.json", "study.json", "study.csv", "study.md"):
        assert (out / name).stat().st_size > 0, name
    for name in ("test_ppl_vs_d.png", "learning_curves.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    cells = _cells(out)
    assert sorted(cells) == [("mos", 4, 1), ("softmax", 4, 1)]
    for (head, d, _), cell in cells.items():
        assert cell["status"] == "done"
        assert 1 < cell["test_ppl"] < 13  # better than uniform over the 12 fixture words
        assert cell["epochs"] <= 2 and cell["stop_reason"]
        assert cell["seconds_per_epoch"] > 0 and cell["params"] > 0
        results = json.loads((out / "cells" / f"{head}-d{d}-s1" / "results.json").read_text())
        assert results["test_ppl"] == cell["test_ppl"]
    # MoS adds the latent projection and the prior to softmax's parameters.
    assert cells[("mos", 4, 1)]["params"] > cells[("softmax", 4, 1)]["params"]
    study = json.loads((out / "study.json").read_text())
    summary = {(e["head"], e["d"]): e for e in study["summary"]}
    gain = summary[("softmax", 4)]["test_ppl"] - summary[("mos", 4)]["test_ppl"]
    np.testing.assert_allclose(summary[("mos", 4)]["gain_ppl"], gain, rtol=1e-6)
    # Ranks for rank_d = 4, one per head, from experiments/rank.py --mode model.
    assert [r["head"] for r in study["ranks"]] == ["softmax", "mos"]
    assert all(r["numerical_rank"] >= 1 for r in study["ranks"])
    assert (out / "rank" / "mos" / "spectrum.png").exists()
    text = (out / "study.md").read_text()
    assert re.search(r"\|\s+4 \| mos\s+\|", text) and "numerical rank" in text
    # The Transformer's head reads d = 4 features of a wider trunk (the preset's d_model 8).
    config = json.loads((out / "cells" / "mos-d4-s1" / "config.json").read_text())["config"]
    assert config["transformer"]["head_features"] == 4 and config["transformer"]["d_model"] == 8
    assert config["head"]["name"] == "mos" and config["model"] == "transformer"


def test_every_finished_cell_has_its_row_in_the_results_csv(smoke):
    out, _ = smoke
    with (out / "rows.csv").open() as f:
        rows = {(r["head"], r["d"], r["seed"]): r for r in csv.DictReader(f)}
    assert list(next(iter(rows.values()))) == list(study.RESULT_COLUMNS)
    for key, cell in _cells(out).items():
        row = rows[(key[0], str(key[1]), str(key[2]))]
        assert float(row["test_ppl"]) == cell["test_ppl"]
        assert row["model"] == "transformer" and row["corpus"] == "ptb"
        assert len(row["valid_curve"].split()) == cell["epochs"]
        assert row["converged"] == str(cell["converged"]) and row["commit"]


def test_cells_recorded_in_the_results_csv_are_not_run_again(smoke, tmp_path):
    reference, _ = smoke
    rows = tmp_path / "rows.csv"
    shutil.copy(reference / "rows.csv", rows)
    hooked = tmp_path / "hook.log"  # the hook is a child process: it writes there
    hook = ("--after_cell", f"echo ran $CELL >> {shlex.quote(str(hooked))}")
    ran = lambda: hooked.read_text().split("\n")[:-1] if hooked.exists() else []  # noqa: E731
    out = tmp_path / "study"  # no cell folders: the rows alone say the cells are done
    code, stdout, stderr = _run("--rank_d", "None", "--out_dir", str(out),
                                "--results_csv", str(rows), *hook)  # fmt: skip
    assert code == 0, stderr
    assert stdout.count("recorded in") == 2 and ran() == []
    assert not (out / "cells").exists()
    assert _cells(out).keys() == _cells(reference).keys()
    # Another config (a longer budget) is another result: the cell runs, its row is replaced.
    code, stdout, stderr = _run("--rank_d", "None", "--out_dir", str(out), "--heads",
                                "softmax", "--epochs", "1", "--results_csv", str(rows),
                                *hook)  # fmt: skip
    assert code == 0, stderr
    assert ran() == ["ran softmax-d4-s1"]
    with rows.open() as f:
        epochs = {r["head"]: r["epochs"] for r in csv.DictReader(f)}
    assert epochs == {"mos": "2", "softmax": "1"}
    # Rerun: the cell's folder is finished and its row recorded, so the hook does not run again.
    code, stdout, stderr = _run("--rank_d", "None", "--out_dir", str(out), "--heads",
                                "softmax", "--epochs", "1", "--results_csv", str(rows),
                                *hook)  # fmt: skip
    assert code == 0, stderr
    assert ran() == ["ran softmax-d4-s1"]


def _softmax_rows_with(reference, tmp_path, **first_row):
    """The smoke grid's softmax rows in a CSV of their own, the first (seed 1's) changed."""
    with (reference / "rows.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["head"] == "softmax"]
    rows[0].update(first_row)
    csv_path = tmp_path / "rows.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=study.RESULT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return csv_path, rows


def test_a_block_another_device_trained_waits_for_a_machine_like_it(smoke, tmp_path):
    """Each head is compared with softmax of its d and seed: where softmax-d4-s1 trained on
    another device, mos-d4-s1 stays pending (never paired across devices) and the grid goes on
    with seed 2's block, which this machine trains; a cell another device began but did not
    finish is set aside and trained afresh here (no checkpoint resumes on another device)."""
    reference, _ = smoke
    csv_path, _ = _softmax_rows_with(reference, tmp_path, device="gpu (Another GPU)")
    out = tmp_path / "study"
    begun = out / "cells" / "softmax-d4-s2"  # an unfinished folder of another CPU
    begun.mkdir(parents=True)
    (begun / lm_study.DEVICE_FILE).write_text("cpu (Other CPU)\n")
    args = ["--rank_d", "None", "--out_dir", str(out), "--results_csv", str(csv_path)]
    code, stdout, stderr = _run(*args, "--seeds", "1", "2")
    assert code == 0, stderr
    assert "mos-d4-s1: deferred: its block (d = 4, seed 1) trained on gpu (Another GPU)" in stdout
    commit = code_commit()  # the folder recorded no config: it trained nothing yet
    assert (
        f"its checkpoint began on cpu (Other CPU) at commit {commit}: set aside in "
        f"{begun}.set-aside-1"
    ) in stdout
    cells = _cells(out)
    assert cells[("mos", 4, 1)]["status"] == "pending"
    assert cells[("softmax", 4, 2)]["status"] == cells[("mos", 4, 2)]["status"] == "done"
    device = cells[("mos", 4, 2)]["device"]
    assert device.startswith("cpu (") and cells[("softmax", 4, 2)]["device"] == device
    assert (begun / lm_study.DEVICE_FILE).read_text().strip() == device
    assert not (out / "cells" / "mos-d4-s1").exists()
    assert "Partial" in (out / "study.md").read_text()


def test_a_block_another_commit_trained_waits_for_that_code(smoke, tmp_path):
    """A block whose softmax cell another commit of the code trained on this same machine:
    mos-d4-s1 stays pending (a pair never compares two codes) and seed 2's block trains here;
    a cell another commit began is set aside and trained afresh (no checkpoint resumes under
    other code), and each new row records this code's commit."""
    reference, _ = smoke
    csv_path, rows = _softmax_rows_with(reference, tmp_path, commit="0123456789ab")
    out = tmp_path / "study"
    begun = out / "cells" / "mos-d4-s2"  # begun here by the other commit, not finished
    begun.mkdir(parents=True)
    device = rows[0]["device"]
    (begun / lm_study.DEVICE_FILE).write_text(device + "\n")
    (begun / "config.json").write_text(json.dumps({"commit": "0123456789ab"}))
    args = ["--rank_d", "None", "--out_dir", str(out), "--results_csv", str(csv_path)]
    code, stdout, stderr = _run(*args, "--seeds", "1", "2")
    assert code == 0, stderr
    here = f"{device} at commit {code_commit()}"
    assert (
        f"mos-d4-s1: deferred: its block (d = 4, seed 1) trained on {device} at commit "
        f"0123456789ab, this is {here}"
    ) in stdout
    assert f"began on {device} at commit 0123456789ab: set aside in {begun}.set-aside-1" in stdout
    cells = _cells(out)
    assert cells[("mos", 4, 1)]["status"] == "pending"
    assert cells[("softmax", 4, 2)]["commit"] == cells[("mos", 4, 2)]["commit"] == code_commit()


@pytest.fixture(scope="module")
def awd_smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("awd_study")
    code, _, stderr = _run("--rank_d", "None", "--out_dir", str(out), preset="awd-smoke")
    assert code == 0, stderr
    return out


def test_the_awd_lstm_grid_still_runs(awd_smoke):
    cells = _cells(awd_smoke)
    assert sorted(cells) == [("mos", 4, 1), ("softmax", 4, 1)]
    assert all(1 < c["test_ppl"] < 13 for c in cells.values())
    config = json.loads((awd_smoke / "cells" / "mos-d4-s1" / "config.json").read_text())["config"]
    assert config["model"] == "awd_lstm" and config["awd_lstm"]["emsize"] == 4


def test_the_committed_grid_rows_are_recognised_by_their_config_sha(tmp_path):
    # The rows' config_sha was computed by the code that ran the grid, `lm_study.py --out_dir
    # /work/grid/ptb/runs --results_csv docs/results/ptb-transformer.csv --data_dir
    # /work/shared/data/ptb`: the same command (or other folders) must make cells of the same
    # digest, or every recorded cell would be trained again.
    rows = study.read_results_csv(RESULTS_CSV)
    assert len(rows) >= 3 and {row["model"] for row in rows.values()} == {"transformer"}
    # A chunk's memory budget changes the speed, not the result: the same digest.
    folders = [
        ("/work/grid/ptb/runs", "/work/shared/data/ptb", []),
        (str(tmp_path), "elsewhere", ["--memory_budget_mib", "16"]),
    ]
    for out_dir, data_dir, more in folders:
        argv = ["--out_dir", out_dir, "--results_csv", str(RESULTS_CSV), "--data_dir", data_dir]
        argv += more
        config = parse_config(study.Config, study.PRESETS, argv)
        for head, d, seed, sha in rows:
            assert study.config_sha(study.cell_config(config, head, d, seed)) == sha
    # What makes a result is in the digest: another rate is another cell.
    config = parse_config(study.Config, study.PRESETS, ["--lr", "0.002"])
    head, d, seed, sha = next(iter(rows))
    assert study.config_sha(study.cell_config(config, head, d, seed)) != sha


# The fixed-trunk grid's report: its flags, and its tuned arm's and probe's CSVs as committed.
PROBE_CSV = ROOT / "docs" / "results" / "ptb-transformer-fixed-probe.csv"  # once it lands
FIXED_FLAGS = (
    "default", "--embedding", "fixed", "--trunk.head.shared_gate_below", "100",
    "--seeds", "1", "2", "3", "4", "5", "--rank_d", "None",
    "--tuned_csvs", *sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "docs" / "results").glob("ptb-transformer-fixed-tuned-*.csv")
    ),
    *(("--probe_csv", str(PROBE_CSV.relative_to(ROOT))) if PROBE_CSV.exists() else ()),
)  # fmt: skip


@pytest.mark.parametrize(
    "flags, name",
    [(("default",), "ptb-transformer"), (("control",), "ptb-transformer-control"),
     (FIXED_FLAGS, "ptb-transformer-fixed")],
    ids=["ptb-transformer", "ptb-transformer-control", "ptb-transformer-fixed"],
)  # fmt: skip
def test_committed_reports_are_what_the_code_writes_from_their_rows(
    flags, name, tmp_path, monkeypatch
):
    """docs/results/NAME.md is `--report_only` on NAME.csv: a row that lands (the grid commits
    them one by one, the tuned arm's too) or a change of the report's code leaves it stale until
    it is rewritten. Only the line saying who wrote it (the commit, the machine, the date) may
    differ."""
    monkeypatch.chdir(ROOT)  # the tuned CSVs by the relative paths the page names
    results = ROOT / "docs" / "results"
    lm_study.main(
        [*flags, "--results_csv", str(results / f"{name}.csv"), "--report_only",
         "--out_dir", str(tmp_path)]
    )  # fmt: skip

    def body(page: Path) -> list[str]:
        return [line for line in page.read_text().splitlines() if not line.startswith("Written by")]

    assert body(tmp_path / "study.md") == body(results / f"{name}.md"), (
        f"docs/results/{name}.md is stale: rerun `python experiments/lm_study.py {' '.join(flags)}"
        f" --results_csv docs/results/{name}.csv --report_only --out_dir DIR` and copy its study.md"
    )


def test_converged_is_early_stopping_or_a_flat_last_three_epochs():
    assert study.converged("early stopping (no improvement for 1 epochs)", [10.0, 11.0])
    assert study.converged("epoch budget (5)", [200.0, 100.0, 99.8, 99.7, 99.6])
    assert not study.converged("epoch budget (5)", [200.0, 100.0, 99.0, 98.0, 97.0])
    assert not study.converged("epoch budget (3)", [200.0, 199.9, 199.8])  # too few epochs


def test_finished_cells_are_skipped_and_a_longer_budget_resumes_them(awd_smoke, tmp_path):
    # The AWD-LSTM's SGD may extend its budget; AdamW's epochs set its schedule (refused).
    reference = awd_smoke
    out = tmp_path / "study"
    flags = ["--rank_d", "None", "--out_dir", str(out)]  # rank: the smoke grid checks it
    code, _, stderr = _run(*flags, "--epochs", "1", preset="awd-smoke")
    assert code == 0, stderr
    assert {c["epochs"] for c in _cells(out).values()} == {1}

    code, stdout, stderr = _run(
        *flags, preset="awd-smoke"
    )  # the preset's 2 epochs: each cell resumes
    assert code == 0, stderr
    assert stderr.count("resumed") == 2
    got, want = _cells(out), _cells(reference)
    for key, cell in got.items():
        assert cell["epochs"] == want[key]["epochs"] == 2
        # Resumed from epoch 1's checkpoint, the cell is the uninterrupted reference cell.
        np.testing.assert_allclose(cell["test_ppl"], want[key]["test_ppl"], rtol=1e-5)

    # Nothing left to do, also with settings that change only how a cell computes.
    code, stdout, stderr = _run(*flags, "--memory_budget_mib", "1", preset="awd-smoke")
    assert code == 0, stderr
    assert "resumed" not in stderr and "epoch 1/" not in stderr


def test_a_failing_cell_is_recorded_and_the_others_finish(tmp_path):
    out = tmp_path / "study"
    blocked = out / "cells" / "mos-d4-s1"
    blocked.mkdir(parents=True)
    (blocked / "config.json").write_text(json.dumps({"experiment": "synthetic"}))
    code, stdout, stderr = _run("--rank_d", "None", "--out_dir", str(out))
    assert code == 1
    assert "cell mos-d4-s1 failed" in stderr and "holds a run of synthetic" in stderr
    cells = _cells(out)
    assert cells[("softmax", 4, 1)]["status"] == "done"
    assert cells[("mos", 4, 1)]["status"] == "failed"
    assert "mos-d4-s1: " in (out / "study.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "softmax", "nope"], "invalid choice 'nope' for argument '--heads'"),
        (["--ds", "4", "4"], "ds must name distinct values, at least one, got (4, 4)"),
        (["--rank_d", "16"], "rank_d 16 is not one of ds (4,)"),
        (["--lr", "nan"], "lr must be finite"),
        (["--patience", "0"], "patience must be >= 1"),
        (["--max_len", "4"], "max_len 4 must cover the longest window"),  # the cells' own check
        (["trunk.model:rnn"], "Unrecognized options: trunk.model:rnn"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm_study.main(["smoke", "--out_dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    text = plain(capsys.readouterr().err)
    assert message in text, text


def test_gains_are_paired_by_seed_and_count_the_seeds_a_head_wins(tmp_path):
    """Each head's gain over softmax is compared seed by seed (they share the data order): the
    spread is the std of the per-seed gains, not of the head's own perplexities."""
    config = study.Config(heads=("softmax", "mos"), ds=(16,), seeds=(1, 2, 3, 4))

    def row(head, seed, ppl):
        return {"head": head, "d": 16, "seed": seed, "status": "done", "test_ppl": ppl,
                "valid_ppl": ppl, "epochs": 5, "stop_reason": "early stopping",
                "converged": True, "seconds_per_epoch": 1.0, "train_seconds": 5.0,
                "params": 10, "device": "cpu"}  # fmt: skip

    softmax, mos = [100.0, 110.0, 120.0], [99.0, 108.0, 121.0]
    rows = [row("softmax", s, p) for s, p in zip((1, 2, 3), softmax, strict=True)]
    rows += [row("mos", s, p) for s, p in zip((1, 2, 3), mos, strict=True)]
    rows.append(row("mos", 4, 105.0))  # no softmax cell of seed 4: in the mean, not the gain
    table = report.summarize(rows, config)
    (entry,) = [e for e in table if e["head"] == "mos"]
    per_seed = 100 * (np.array(softmax) - np.array(mos)) / np.array(softmax)
    np.testing.assert_allclose(entry["gain_pct_std"], np.std(per_seed, ddof=1), rtol=1e-12)
    assert (entry["better_seeds"], entry["paired_seeds"]) == (2, 3)
    np.testing.assert_allclose(entry["gain_pct"], np.mean(per_seed), rtol=1e-12)
    np.testing.assert_allclose(entry["seed_gains_pct"], per_seed, rtol=1e-12)
    np.testing.assert_allclose(entry["gain_ppl"], np.mean(softmax) - np.mean(mos), rtol=1e-12)
    np.testing.assert_allclose(entry["test_ppl"], np.mean(mos + [105.0]), rtol=1e-12)
    rows.append(row("plif", 4, 90.0))  # its one seed has no softmax cell: no gain at all
    table = report.summarize(rows, dataclasses.replace(config, heads=("softmax", "mos", "plif")))
    (plif,) = [e for e in table if e["head"] == "plif"]
    assert "gain_pct" not in plif and "better_seeds" not in plif
    text = report.markdown(table, rows, config)
    assert f"{entry['gain_pct']:+.2f} ± {entry['gain_pct_std']:.2f}" in text and "| 2/3 " in text
    grid = report.gains_by_d(table, config, decimals=1)  # the head x d grid for a README
    low, high = stats.t.interval(
        0.95, 2, loc=per_seed.mean(), scale=np.std(per_seed, ddof=1) / np.sqrt(3)
    )
    assert grid == [
        {"head": "softmax (test ppl)", "d = 16": f"110.0 ± {np.std(softmax, ddof=1):.1f}",
         "published (PTB)": "58.37, 58.8"},  # the baselines the published gains are against
        {"head": "mos", "d = 16": f"{entry['gain_pct']:+.2f} [{low:+.2f}, {high:+.2f}] (2/3)",
         "published (PTB)": "+3.32% vs 58.37 (other model)"},  # Yang et al.'s MoS: another model
    ]  # fmt: skip
    assert grid[1]["d = 16"] in text  # the report carries the grid under its table
    wider = dataclasses.replace(config, heads=("softmax", "sigsoftmax", "mos", "plif"), ds=(16, 32))
    rows.append(row("mos", 1, 95.0) | {"d": 32})  # no softmax cell at d = 32: a blank beside it
    grid = report.gains_by_d(report.summarize(rows, wider), wider, decimals=1)
    assert [r["head"] for r in grid] == ["softmax (test ppl)", "mos", "plif"]  # no sigsoftmax cell
    assert [r["d = 32"] for r in grid] == ["", "—", ""] and grid[2]["d = 16"] == "—"
    published = {h: r.text() for h, r in report.PUBLISHED_PTB.items()}
    assert published == {"softmax": "58.37", "sigsoftmax": "+0.68% vs 58.8",  # Kanai's softmax
                         "plif": "+1.92% vs 58.37", "mos": "+3.32% vs 58.37 (other model)"}  # fmt: skip
    control = study.PRESETS["control"]  # 64 words: not the papers' setting, no such column
    at_64 = [r | {"d": 64} for r in rows if r["head"] == "softmax"]
    (softmax_row,) = report.gains_by_d(report.summarize(at_64, control), control, decimals=1)
    assert "published (PTB)" not in softmax_row
    report.plot_vs_d(table, config, tmp_path / "vs_d.png")
    assert (tmp_path / "vs_d.png").read_bytes()[:4] == b"\x89PNG"


def test_cost_is_the_ratio_to_softmax_seed_by_seed():
    """Seeds that ran on machines of different speeds: each seed's ratio to its own softmax is
    what the cost grid gives (the median and range over seeds), not the ratio of medians."""
    config = study.Config(heads=("softmax", "plif", "mos"), ds=(16, 32), seeds=(1, 2, 3))

    def row(head, seed, seconds, d=16):
        return {"head": head, "d": d, "seed": seed, "status": "done", "test_ppl": 100.0,
                "valid_ppl": 100.0, "epochs": 5, "stop_reason": "early stopping",
                "converged": True, "seconds_per_epoch": seconds, "train_seconds": 5 * seconds,
                "params": 10, "device": "cpu"}  # fmt: skip

    softmax, mos = [60.0, 60.0, 120.0], [150.0, 180.0, 240.0]  # seed 3: a machine 2x slower
    rows = [row("softmax", s, t) for s, t in zip((1, 2, 3), softmax, strict=True)]
    rows += [row("mos", s, t) for s, t in zip((1, 2, 3), mos, strict=True)]
    rows += [row("plif", 1, 70.0), row("plif", 4, 90.0)]  # seed 4: no softmax, no ratio
    rows += [row("mos", 1, 50.0, d=32)]  # no softmax cell at d = 32
    table = report.summarize(rows, config)
    (entry,) = [e for e in table if e["head"] == "mos" and e["d"] == 16]
    ratios = (entry["time_ratio"], entry["time_ratio_min"], entry["time_ratio_max"])
    assert ratios == (2.5, 2.0, 3.0)  # not 200 / 60: the ratio of the medians
    grid = report.costs_by_d(table, config)
    assert grid == [
        {"head": "plif", "d = 16": "1.17×", "d = 32": "", "published (PTB)": "1.17×"},
        {"head": "mos", "d = 16": "2.50× (2.00–3.00)", "d = 32": "—", "published (PTB)": "2.50×"},
    ]  # fmt: skip  (Ganea et al.'s ~70 and ~150 s per epoch against softmax's ~60)
    text = report.markdown(table, rows, config)
    assert "2.50× (2.00–3.00)" in text
    # 5 epochs of 60+60+120+150+180+240+70+90+50 s = 5100 s in all
    assert "the 9 finished cells trained for 1.4 hours in all" in " ".join(text.split())
    control = study.PRESETS["control"]  # 64 words: not the papers' setting, no such column
    at_64 = report.summarize([r | {"d": 64} for r in rows if r["d"] == 16], control)
    assert "published (PTB)" not in report.costs_by_d(at_64, control)[0]
    # Seed 3's mos and plif trained on a GPU: out of the seconds (a ratio to the CPU's softmax
    # would read as mos being 50x faster), in the perplexities and the compute, by device.
    gpu = {"device": "gpu (NVIDIA H200)", "seconds_per_epoch": 5.0, "train_seconds": 25.0}
    rows = [r | gpu if (r["seed"], r["head"]) == (3, "mos") else r for r in rows]
    rows.append(row("plif", 3, 5.0) | gpu | {"test_ppl": 90.0})
    table = report.summarize(rows, config)
    plif, mos = [e for e in table if e["d"] == 16 and e["head"] in ("mos", "plif")]  # config order
    assert (mos["time_ratio"], mos["time_ratio_min"], mos["time_ratio_max"]) == (2.75, 2.5, 3.0)
    assert (mos["s_per_epoch"], plif["s_per_epoch"]) == (165.0, 80.0)  # seeds 1 and 2; 1 and 4
    assert plif["test_ppl"] == np.mean([100.0, 100.0, 90.0]) and plif["time_ratio"] == 70 / 60
    text = " ".join(report.markdown(table, rows, config).split())
    # 5 epochs of 60+60+120+150+180+70+90+50 s on the CPU, 5 of 5+5 s on the GPU
    assert (
        "the 10 finished cells trained for 1.1 hours on cpu for 8 cells and 0.0 hours on gpu "
        "(NVIDIA H200) for 2 cells (the sum" in text
    )
    assert "compare only the cells trained on cpu: mos-d16-s3, plif-d16-s3 count" in text
    # A head and d whose cells all trained on the GPU has no seconds: a dash, not a number.
    rows = [r | gpu if r["d"] == 32 else r for r in rows]
    (mos_32,) = [e for e in report.summarize(rows, config) if e["d"] == 32]
    assert mos_32["s_per_epoch"] is None and report._table_row(mos_32, 1)["s/epoch"] == "—"


def test_report_only_tabulates_the_recorded_cells_and_lists_the_rest(smoke, tmp_path):
    reference, _ = smoke
    out = tmp_path / "report"
    code, stdout, stderr = _run("--heads", "softmax", "sigsoftmax", "mos", "--rank_d", "None",
                                "--results_csv", str(reference / "rows.csv"), "--report_only",
                                "--out_dir", str(out))  # fmt: skip
    assert code == 0, stderr
    assert "epoch 1/" not in stderr and not (out / "cells").exists()
    text = (out / "study.md").read_text()
    assert text.splitlines()[0].endswith(" — partial") and "pending: sigsoftmax-d4-s1." in text
    assert re.search(r"\|\s+4 \| mos\s+\|", text) and "| sigsoftmax" not in text
    assert {c["status"] for c in json.loads((out / "study.json").read_text())["cells"]} == {
        "done",
        "pending",
    }
    code, _, stderr = _run("--report_only", "--out_dir", str(tmp_path / "x"))
    assert code == 2 and "report_only reads --results_csv" in stderr


@pytest.mark.parametrize("flag", ["--results_csv", "--probe_csv", "--tuned_csvs"])
def test_a_missing_csv_the_report_reads_is_one_error_before_any_cell(flag, tmp_path):
    """A misspelt path is not an arm (or a grid) with no cell yet."""
    missing = tmp_path / "no-such-rows.csv"
    extra = ("--report_only",) if flag == "--results_csv" else ()
    code, _, stderr = _run(flag, str(missing), *extra, "--out_dir", str(tmp_path / "out"))
    assert code == 2 and f"{flag} {missing}: no such file" in stderr, stderr
    assert not (tmp_path / "out" / "cells").exists()


def test_paired_t_is_scipy_s_paired_test_and_interval():
    """Three per-seed gains worked with numpy/scipy: the interval is mean +- t_{0.975, 2} s /
    sqrt(3), the p-value the paired t test's of the two heads' perplexities."""
    softmax, head = np.array([120.0, 118.0, 125.0]), np.array([118.5, 118.2, 122.0])
    gains = 100 * (softmax - head) / softmax
    got = paired_stats.paired_t(gains)
    half = 4.302652729749462 * gains.std(ddof=1) / np.sqrt(3)  # t_{0.975, 2}
    np.testing.assert_allclose(
        [got["ci_low"], got["ci_high"]], [gains.mean() - half, gains.mean() + half]
    )
    t = gains.mean() / (gains.std(ddof=1) / np.sqrt(3))
    np.testing.assert_allclose(got["p"], 2 * stats.t.sf(abs(t), 2), rtol=1e-10)
    np.testing.assert_allclose(got["p"], stats.ttest_rel(softmax / softmax, head / softmax).pvalue)
    assert paired_stats.paired_t([1.0]) is None  # one seed: no spread, no test
    assert (
        paired_stats.paired_t([2.0, 2.0])["p"] == 0.0
        and paired_stats.paired_t([0.0, 0.0])["p"] == 1.0
    )


def test_holm_adjusts_step_down_and_keeps_order():
    # Sorted 0.001, 0.01, 0.02, 0.04 of m = 4: 0.004, 0.03, max(0.03, 0.04), max(0.04, 0.04).
    np.testing.assert_allclose(
        paired_stats.holm([0.04, 0.001, 0.02, 0.01]), [0.04, 0.004, 0.04, 0.03]
    )
    assert paired_stats.holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1
    assert paired_stats.holm([]) == []


def test_power_of_the_paired_t_test():
    """The noncentral t's power against a simulation, and its inverses."""
    rng = np.random.default_rng(0)
    effect, spread, n = 2.0, 1.0, 4
    samples = rng.normal(effect, spread, size=(40_000, n))
    t = samples.mean(1) / (samples.std(1, ddof=1) / np.sqrt(n))
    simulated = np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1))
    assert abs(paired_stats.paired_power(effect, spread, n) - simulated) < 0.01
    detectable = paired_stats.detectable_gain(0.75, 3)
    np.testing.assert_allclose(paired_stats.paired_power(detectable, 0.75, 3), 0.8, atol=1e-9)
    assert 2.4 < detectable < 2.5  # about 3.26 spreads with three seeds
    needed = paired_stats.seeds_needed(1.0, 0.75)
    assert needed == 7  # Issue #48's estimate
    assert (
        paired_stats.paired_power(1.0, 0.75, needed - 1)
        < 0.8
        <= paired_stats.paired_power(1.0, 0.75, needed)
    )


def test_gain_trend_is_the_mean_of_each_seeds_slope_on_log2_d():
    """Seeds are the replicates: each seed's least-squares slope on log2 d (np.polyfit), their
    mean with a one-sample t interval over the seeds; a seed at one d has no slope."""
    ds = [16, 32, 64, 128] * 3 + [16]
    seeds = [1] * 4 + [2] * 4 + [3] * 4 + [4]  # seed 4: one d, no slope
    gains = [2.0, 1.0, 0.0, -1.0, 1.0, 1.5, 0.5, -0.5, 0.5, 0.0, 0.5, -2.0, 9.0]
    trend = paired_stats.gain_trend(ds, gains, seeds)
    slopes = [np.polyfit(np.log2(ds[i : i + 4]), gains[i : i + 4], 1)[0] for i in (0, 4, 8)]
    half = stats.t.ppf(0.975, 2) * np.std(slopes, ddof=1) / np.sqrt(3)
    np.testing.assert_allclose(trend["seed_slopes"], slopes, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        [trend["slope"], trend["ci_low"], trend["ci_high"], trend["p"]],
        [np.mean(slopes), np.mean(slopes) - half, np.mean(slopes) + half,
         stats.ttest_1samp(slopes, 0.0).pvalue],
        rtol=1e-10,
    )  # fmt: skip
    assert trend["seeds"] == 3
    # On a complete grid the mean slope is the regression pooled over the cells.
    np.testing.assert_allclose(trend["slope"], np.polyfit(np.log2(ds[:12]), gains[:12], 1)[0])
    assert paired_stats.gain_trend([16, 16, 16], [1.0, 2.0, 3.0], [1, 2, 3]) is None
    assert paired_stats.gain_trend([16, 32], [1.0, 2.0], [1, 1]) is None  # one seed


def test_report_gives_intervals_holm_power_trend_and_device_crossings():
    """Two heads, two d's, three seeds; seed 3's mos at d = 32 trained on a GPU, its softmax on
    the CPU: the pair crosses devices and the report gives the gain without it too."""
    config = study.Config(heads=("softmax", "plif", "mos"), ds=(16, 32), seeds=(1, 2, 3))

    def row(head, d, seed, ppl, device="cpu"):
        return {"head": head, "d": d, "seed": seed, "status": "done", "test_ppl": ppl,
                "valid_ppl": ppl, "epochs": 5, "stop_reason": "early stopping",
                "converged": True, "seconds_per_epoch": 1.0, "train_seconds": 5.0,
                "params": 10 * d, "device": device, "valid_curve": "3.0 2.0"}  # fmt: skip

    ppl = {"softmax": [100.0, 102.0, 101.0], "plif": [99.0, 101.5, 99.5], "mos": [98.0, 99.0, 97.0]}
    rows = [
        row(head, d, seed, p + (d == 32) * 10, "gpu" if (head, d, seed) == ("mos", 32, 3) else "cpu")
        for head, values in ppl.items() for d in (16, 32) for seed, p in zip((1, 2, 3), values, strict=True)
    ]  # fmt: skip
    table = report.summarize(rows, config)
    entries = {(e["head"], e["d"]): e for e in table if e["head"] != "softmax"}
    p_values = [entries[k]["p_value"] for k in entries]
    np.testing.assert_allclose([entries[k]["p_holm"] for k in entries], paired_stats.holm(p_values))
    assert {e["comparisons"] for e in entries.values()} == {4}
    mos32 = entries[("mos", 32)]
    assert mos32["cross_device_seeds"] == [3] and entries[("mos", 16)]["cross_device_seeds"] == []
    kept = [100 * (s - h) / s for s, h in ((110.0, 108.0), (112.0, 109.0))]  # seeds 1 and 2
    np.testing.assert_allclose(mos32["same_device"]["gain_pct"], np.mean(kept))
    text = report.markdown(table, rows, config)
    assert "Holm over all 4 head × d comparisons" in " ".join(text.split())
    plif16 = entries[("plif", 16)]
    low, high = plif16["gain_ci"]
    reading = "no detectable difference" if low <= 0 <= high else "gain"
    assert f"[{low:+.2f}, {high:+.2f}]" in text and reading in text
    assert "seed 3 crosses" in text and f"{np.mean(kept):+.2f}" in text
    spread = np.median([e["gain_pct_std"] for e in entries.values()])
    assert f"{paired_stats.detectable_gain(spread, 3):.2f}" in text
    trend = paired_stats.gain_trend(
        [16] * 3 + [32] * 3,
        plif16["seed_gains_pct"] + entries[("plif", 32)]["seed_gains_pct"],
        [1, 2, 3] * 2,
    )
    assert f"{trend['slope']:+.2f}" in text
    trends = report.gain_trends(table, config)  # plif's and mos's, one family for Holm
    assert [t["head"] for t in trends] == ["plif", "mos"] and trends[0]["slope"] == trend["slope"]
    assert [t["p_holm"] for t in trends] == paired_stats.holm([t["p"] for t in trends])
    grid = report.gains_by_d(table, config, decimals=1)
    assert grid[2]["d = 32"].endswith("(3/3)†") and not grid[2]["d = 16"].endswith("†")


def test_the_power_table_gives_each_row_its_own_seeds():
    """A partial grid: three seeds at d = 16, two at d = 32. Each row of the power table is
    sized with the fewest paired seeds of its comparisons, named in its own column."""
    config = study.Config(heads=("softmax", "mos"), ds=(16, 32), seeds=(1, 2, 3))
    ppl = {(16, 1): (100.0, 98.0), (16, 2): (101.0, 98.5), (16, 3): (99.0, 97.8),
           (32, 1): (90.0, 88.0), (32, 2): (91.0, 89.5)}  # fmt: skip
    rows = [
        _csv_row(head, d, seed, pair[i])
        for (d, seed), pair in ppl.items()
        for i, head in enumerate(("softmax", "mos"))
    ]
    table = report.summarize(rows, config)
    spreads = {s["spread"]: s for s in report.design_spreads(table)}
    assert spreads["pooled at d = 16"]["seeds"] == 3 and spreads["pooled at d = 32"]["seeds"] == 2
    assert spreads["median over all comparisons"]["seeds"] == 2
    text = report.markdown(table, rows, config)
    d32 = spreads["pooled at d = 32"]
    row = next(line for line in text.splitlines() if "pooled at d = 32" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "2" and cells[3] == f"{paired_stats.detectable_gain(d32['value'], 2):.2f}"


def _section(page, start):
    """The paragraph of a report page that begins with ``start``, and the table after it."""
    return "\n\n".join(page[page.index(start) :].split("\n\n")[:2])


def _csv_row(head, d, seed, test, valid=None, lr=None, dropout=None, epochs=13):
    return {"corpus": "ptb", "model": "transformer", "vocab_size": None, "head": head, "d": d,
            "seed": seed, "status": "done", "valid_ppl": valid or test, "test_ppl": test,
            "epochs": epochs, "best_epoch": epochs, "stop_reason": "epoch budget (13)",
            "converged": False, "seconds_per_epoch": 1.0, "train_seconds": 13.0, "params": 10,
            "valid_curve": "3.0 2.0", "commit": "abc", "config_sha": f"{head}{d}{seed}{lr}",
            "device": "cpu (X)", "lr": lr, "dropout": dropout}  # fmt: skip


def test_the_tuned_arm_picks_each_head_s_setting_by_its_first_seed(tmp_path):
    """Two settings besides the recipe's at d = 128, seeds 1-3: each head takes the setting of
    its best seed-1 validation (softmax the recipe, plif lr 0.001), and plif's tuned gain is
    over softmax at softmax's choice, paired by seed, beside the recipe's gain on those seeds."""
    config = study.Config(heads=("softmax", "plif"), ds=(128,), seeds=(1, 2, 3, 4), rank_d=None,
                             results_csv=str(tmp_path / "grid.csv"),
                             tuned_csvs=(str(tmp_path / "lr1e-3.csv"), str(tmp_path / "p0.2.csv")))  # fmt: skip
    recipe = {"softmax": [100.0, 101.0, 102.0, 103.0], "plif": [104.0, 103.0, 106.0, 107.0]}
    grid = [_csv_row(h, 128, s, p) for h, ps in recipe.items() for s, p in enumerate(ps, 1)]
    tuned = {  # (csv, lr, dropout): head: seed-1 validation, test ppl of seeds 1-3
        ("lr1e-3.csv", 0.001, 0.1): {"softmax": (105.0, [101, 102, 103]), "plif": (95.0, [98.0, 97.0, 99.5])},
        ("p0.2.csv", 0.003, 0.2): {"softmax": (101.0, [99, 99, 99]), "plif": (99.0, [90.0, 90.0, 90.0])},
    }  # fmt: skip
    for row in grid:
        study.merge_results_csv(Path(config.results_csv), row)
    for (name, lr, dropout), heads in tuned.items():
        for head, (valid, tests) in heads.items():
            for seed, test in enumerate(tests, 1):
                row = _csv_row(head, 128, seed, test, valid if seed == 1 else test, lr, dropout)
                study.merge_results_csv(tmp_path / name, row)
    rows = [
        {**r, "status": "done"} for r in study.read_results_csv(Path(config.results_csv)).values()
    ]
    entries = {e["head"]: e for e in report.tuned_arm(config, rows)}
    recipe_setting = (config.trunk.optimizer.lr, study.main_dropout(config.trunk.model))
    assert entries["softmax"]["setting"] == recipe_setting  # 100 < 101 < 105 at seed 1
    assert entries["plif"]["setting"] == (0.001, 0.1)  # 95 < 99 < 104
    assert entries["plif"]["seeds"] == [1, 2, 3]  # the arm's seeds, not the grid's fourth
    gains = [100 * (b - h) / b for b, h in zip(recipe["softmax"], [98.0, 97.0, 99.5], strict=False)]
    np.testing.assert_allclose(entries["plif"]["tuned"]["gain_pct"], np.mean(gains))
    recipe_gains = [
        100 * (b - h) / b for b, h in zip(recipe["softmax"], recipe["plif"], strict=True)
    ][:3]
    np.testing.assert_allclose(entries["plif"]["recipe"]["gain_pct"], np.mean(recipe_gains))
    text = _section(report.markdown(report.summarize(rows, config), rows, config), "**Tuned arm**")
    assert "lr 0.001, dropout 0.1" in text and "95.00" in text
    assert "| same" in text and "crosses" not in text


def test_the_tuned_arm_corrects_each_column_s_p_values_by_holm_over_its_heads(tmp_path):
    """Two heads against softmax in the arm: each column's gains (tuned, recipe) are one
    family, their p-values Holm-adjusted together, and the page shows the adjusted ones."""
    config = study.Config(heads=("softmax", "sigsoftmax", "plif"), ds=(128,), seeds=(1, 2, 3),
                          rank_d=None, results_csv=str(tmp_path / "grid.csv"),
                          tuned_csvs=(str(tmp_path / "lr1e-3.csv"),))  # fmt: skip
    recipe = {"softmax": [100.0, 101.0, 102.0], "sigsoftmax": [103.0, 104.5, 104.0],
              "plif": [99.0, 100.5, 100.0]}  # fmt: skip
    tuned = {"softmax": [98.0, 99.0, 100.5], "sigsoftmax": [101.0, 102.0, 104.0],
             "plif": [97.5, 98.0, 100.0]}  # fmt: skip
    for head, tests in recipe.items():
        for seed, test in enumerate(tests, 1):
            study.merge_results_csv(Path(config.results_csv), _csv_row(head, 128, seed, test))
    for head, tests in tuned.items():
        for seed, test in enumerate(tests, 1):  # seed 1 validates below the recipe's
            row = _csv_row(head, 128, seed, test, test - 5 if seed == 1 else test, 0.001, 0.1)
            study.merge_results_csv(tmp_path / "lr1e-3.csv", row)
    rows = [
        {**r, "status": "done"} for r in study.read_results_csv(Path(config.results_csv)).values()
    ]
    entries = [e for e in report.tuned_arm(config, rows) if e["head"] != "softmax"]
    for arm, ppl in (("tuned", tuned), ("recipe", recipe)):
        base = np.array(ppl["softmax"])
        gains = [100 * (base - np.array(ppl[e["head"]])) / base for e in entries]
        p_values = [paired_stats.paired_t(g)["p"] for g in gains]
        assert [e[arm]["p_value"] for e in entries] == p_values
        assert [e[arm]["p_holm"] for e in entries] == paired_stats.holm(p_values)
    assert entries[0]["tuned"]["p_holm"] != entries[0]["tuned"]["p_value"]  # two in the family
    text = _section(report.markdown(report.summarize(rows, config), rows, config), "**Tuned arm**")
    sig = next(line for line in text.splitlines() if line.startswith("| sigsoftmax"))
    assert f"| {entries[0]['tuned']['p_holm']:.3f} " in sig
    assert f"| {entries[0]['recipe']['p_holm']:.3f} " in sig


def test_the_tuned_arm_names_a_choice_or_a_pair_across_devices(tmp_path):
    """A setting trained on another device than the others (the recipe's cells on a CPU, the
    tuned settings on a GPU): the choice compares devices, and so does a pair with softmax."""
    config = study.Config(heads=("softmax", "plif"), ds=(128,), seeds=(1, 2), rank_d=None,
                          results_csv=str(tmp_path / "grid.csv"),
                          tuned_csvs=(str(tmp_path / "lr1e-3.csv"),))  # fmt: skip
    for head, tests in {"softmax": [100.0, 101.0], "plif": [104.0, 103.0]}.items():
        for seed, test in enumerate(tests, 1):
            study.merge_results_csv(Path(config.results_csv), _csv_row(head, 128, seed, test))
    gpu = {"softmax": (105.0, [101.0, 102.0]), "plif": (95.0, [98.0, 97.0])}
    for head, (valid, tests) in gpu.items():
        for seed, test in enumerate(tests, 1):
            row = _csv_row(head, 128, seed, test, valid if seed == 1 else test, 0.001, 0.1)
            study.merge_results_csv(tmp_path / "lr1e-3.csv", {**row, "device": "gpu (Y)"})
    rows = [
        {**r, "status": "done"} for r in study.read_results_csv(Path(config.results_csv)).values()
    ]
    entries = {e["head"]: e for e in report.tuned_arm(config, rows)}
    # softmax keeps the recipe (100 < 105), plif takes the GPU's setting (95 < 104)
    assert entries["plif"]["choice_devices"] == ["cpu (X)", "gpu (Y)"]
    assert entries["plif"]["tuned"]["cross_device_seeds"] == [1, 2]
    text = _section(report.markdown(report.summarize(rows, config), rows, config), "**Tuned arm**")
    assert "choice across cpu (X) and gpu (Y); seed 1 crosses, seed 2 crosses" in text


def test_a_tuned_csv_of_the_recipe_s_setting_takes_the_place_of_the_grid_s_cells(tmp_path):
    """The recipe's seed 1 retrained on the device of the arm's other settings (the grid's
    seed-1 cells trained on another): its cells make the choice and the recipe's gain."""
    config = study.Config(heads=("softmax", "plif"), ds=(128,), seeds=(1, 2), rank_d=None,
                          results_csv=str(tmp_path / "grid.csv"),
                          tuned_csvs=(str(tmp_path / "recipe.csv"), str(tmp_path / "lr1e-3.csv")))  # fmt: skip
    lr, dropout = config.trunk.optimizer.lr, study.main_dropout(config.trunk.model)
    grid = {("softmax", 1, "cpu (X)"): 100.0, ("plif", 1, "cpu (X)"): 104.0,
            ("softmax", 2, "cpu (Y)"): 101.0, ("plif", 2, "cpu (Y)"): 99.0}  # fmt: skip
    for (head, seed, device), test in grid.items():
        study.merge_results_csv(
            tmp_path / "grid.csv", {**_csv_row(head, 128, seed, test), "device": device}
        )
    retrained = {  # (csv, lr): head: test ppl (= validation) of seeds 1, 2, ... on cpu (Y)
        ("recipe.csv", lr): {"softmax": [102.0], "plif": [100.0]},
        ("lr1e-3.csv", 0.001): {"softmax": [103.0, 103.5], "plif": [101.0, 101.5]},
    }  # fmt: skip
    for (name, rate), heads in retrained.items():
        for head, tests in heads.items():
            for seed, test in enumerate(tests, 1):
                row = _csv_row(head, 128, seed, test, lr=rate, dropout=dropout)
                study.merge_results_csv(tmp_path / name, {**row, "device": "cpu (Y)"})
    rows = [
        {**r, "status": "done"} for r in study.read_results_csv(Path(config.results_csv)).values()
    ]
    entries = {e["head"]: e for e in report.tuned_arm(config, rows)}
    # plif: the recipe (100 < 101), which the grid's own seed-1 cell (104) would not have won
    assert entries["plif"]["setting"] == (lr, dropout)
    assert entries["plif"]["first_seed_valid"] == {(0.001, dropout): 101.0, (lr, dropout): 100.0}
    assert entries["plif"]["choice_devices"] == ["cpu (Y)"]
    gains = [100 * (102 - 100) / 102, 100 * (101 - 99) / 101]  # seed 1 retrained, seed 2 grid's
    np.testing.assert_allclose(entries["plif"]["recipe"]["gain_pct"], np.mean(gains))
    np.testing.assert_allclose(entries["plif"]["tuned"]["gain_pct"], np.mean(gains))


def test_five_seeds_have_five_line_styles_in_the_learning_curves():
    """The fixed-trunk grid has five seeds: the fifth must not repeat the first's line."""
    config = study.Config(seeds=(1, 2, 3, 4, 5), rank_d=None)
    styles = [report._seed_line_style(config, seed) for seed in config.seeds]
    assert len({str(s) for s in styles}) == 5


def test_a_partial_tuned_arm_names_the_cells_it_lacks(tmp_path):
    """softmax has tried both settings at seed 1 and lacks seeds 2 and 3 at its choice; plif
    has only the recipe's seed 1 (its grid cells give seeds 2 and 3 of the recipe): its choice
    is provisional, and the report says so in the table and in the list of missing cells."""
    config = study.Config(heads=("softmax", "plif"), ds=(128,), seeds=(1, 2, 3), rank_d=None,
                          results_csv=str(tmp_path / "grid.csv"),
                          tuned_csvs=(str(tmp_path / "lr1e-3.csv"),))  # fmt: skip
    for head, tests in {"softmax": [100.0, 101.0, 102.0], "plif": [99.0, 100.0, 101.0]}.items():
        for seed, test in enumerate(tests, 1):
            study.merge_results_csv(Path(config.results_csv), _csv_row(head, 128, seed, test))
    study.merge_results_csv(tmp_path / "lr1e-3.csv", _csv_row("softmax", 128, 1, 98.0, 98.0, 0.001, 0.1))  # fmt: skip
    rows = [
        {**r, "status": "done"} for r in study.read_results_csv(Path(config.results_csv)).values()
    ]
    entries = {e["head"]: e for e in report.tuned_arm(config, rows)}
    assert entries["softmax"]["setting"] == (0.001, 0.1)
    assert entries["softmax"]["pending_settings"] == []
    assert entries["softmax"]["pending_seeds"] == [2, 3]
    recipe = (config.trunk.optimizer.lr, study.main_dropout(config.trunk.model))
    assert entries["plif"]["setting"] == recipe and entries["plif"]["seeds"] == [1, 2, 3]
    assert entries["plif"]["pending_settings"] == [(0.001, 0.1)]
    assert entries["plif"]["pending_seeds"] == []
    text = _section(report.markdown(report.summarize(rows, config), rows, config), "**Tuned arm**")
    assert "(so far: 1 of 2)" in text and text.count("so far") == 1
    page = report.markdown(report.summarize(rows, config), rows, config)
    assert (
        "not recorded yet: softmax: seeds 2 and 3 at lr 0.001, dropout 0.1; "
        "plif: seed 1 at lr 0.001, dropout 0.1." in " ".join(page.split())
    )


def test_a_whole_tuned_arm_is_not_called_partial(tmp_path):
    config = study.Config(heads=("softmax", "plif"), ds=(128,), seeds=(1,), rank_d=None,
                          tuned_seeds=(1,), results_csv=str(tmp_path / "grid.csv"),
                          tuned_csvs=(str(tmp_path / "lr1e-3.csv"),))  # fmt: skip
    for head, test in {"softmax": 100.0, "plif": 99.0}.items():
        study.merge_results_csv(Path(config.results_csv), _csv_row(head, 128, 1, test))
        row = _csv_row(head, 128, 1, test + 1, test + 1, 0.001, 0.1)
        study.merge_results_csv(tmp_path / "lr1e-3.csv", row)
    rows = [
        {**r, "status": "done"} for r in study.read_results_csv(Path(config.results_csv)).values()
    ]
    page = report.markdown(report.summarize(rows, config), rows, config)
    assert "**Tuned arm**" in page and "partial" not in page and "so far" not in page


def test_the_convergence_probe_compares_a_longer_budget_with_the_gain_s_half_width(tmp_path):
    config = study.Config(heads=("softmax", "mos"), ds=(32,), seeds=(1, 2, 3), rank_d=None,
                             probe_csv=str(tmp_path / "probe.csv"))  # fmt: skip
    rows = [_csv_row("softmax", 32, s, 100.0 + s) for s in (1, 2, 3)]
    rows += [
        _csv_row("mos", 32, s, p) for s, p in zip((1, 2, 3), (99.0, 100.0, 103.0), strict=True)
    ]
    table = report.summarize(rows, config)
    (mos,) = [e for e in table if e["head"] == "mos"]
    half = (mos["gain_ci"][1] - mos["gain_ci"][0]) / 2
    study.merge_results_csv(tmp_path / "probe.csv", _csv_row("softmax", 32, 1, 100.5, epochs=26))
    study.merge_results_csv(tmp_path / "probe.csv", _csv_row("mos", 32, 1, 90.0, epochs=26))
    entries = {e["head"]: e for e in report.convergence_probe(config, rows, table)}
    np.testing.assert_allclose(entries["softmax"]["change_pct"], 100 * (100.5 - 101) / 101)
    np.testing.assert_allclose(entries["mos"]["change_pct"], 100 * (90 - 99) / 99)
    assert entries["softmax"]["half_width"] == entries["mos"]["half_width"] == half
    text = _section(report.markdown(table, rows, config), "**Convergence probe**")
    assert "13 → 26" in text and "| yes " in text and "| no " in text


def test_the_fixed_embedding_keeps_the_trunk_across_d_under_digests_of_its_own(capsys):
    fixed = parse_config(study.Config, study.PRESETS, ["--embedding", "fixed"])
    factorized = parse_config(study.Config, study.PRESETS, [])
    assert factorized.embedding == "factorized"
    for d in fixed.ds:
        cell = study.cell_config(fixed, "softmax", d, 1)
        assert (cell.model.head_features, cell.model.embedding_features) == (d, 128)
        old = study.cell_config(factorized, "softmax", d, 1)
        assert old.model.embedding_features is None
        assert study.config_sha(cell) != study.config_sha(old)
    narrow = parse_config(
        study.Config, study.PRESETS, ["--embedding", "fixed", "--embedding_features", "64"]
    )
    assert study.cell_config(narrow, "mos", 16, 1).model.embedding_features == 64
    assert "(fixed trunk: decoder E Q)" in report.title(fixed, [])
    for argv, message in [
        (["--embedding_features", "64"], "give it with --embedding fixed"),
        (["awd-smoke", "--embedding", "fixed"], "is a Transformer's"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(study.Config, study.PRESETS, argv)
        assert message in plain(capsys.readouterr().err)


def test_the_report_names_the_trunk_and_mixtape_s_gate_sharing_from_the_config():
    """A fixed-trunk grid with gate sharing is not described as the factorized grid without it."""
    trunk = study.Config().trunk
    sharing = dataclasses.replace(
        trunk, head=dataclasses.replace(trunk.head, shared_gate_below=100)
    )
    fixed = study.Config(embedding="fixed", trunk=sharing)
    text = _section(report.markdown([], [], fixed), "The grid:")
    assert "fixed trunk" in text and "factorized" not in text
    assert "words seen fewer than 100 times" in text and "without gate sharing" not in text
    old = _section(report.markdown([], [], study.Config()), "The grid:")
    assert "factorized-embedding trunk" in old and "Mixtape without gate sharing" in old
