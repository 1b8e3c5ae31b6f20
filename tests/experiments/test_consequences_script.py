"""experiments/consequences.py on smoke runs: the decoder's unargmaxable set, the estimate."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn
from bottleneck.runs import UsageError
from bottleneck.runs.language_model import load_run
from experiments import consequences
from tests.paths import ROOT
from tests.usage import plain


@pytest.fixture(scope="module")
def runs(smoke_run):
    return {"softmax": smoke_run("transformer_softmax"), "mos": smoke_run("transformer_mos")}


def test_rows_follow_the_library_functions(runs, tmp_path):
    out = tmp_path / "c.json"
    rows = consequences.main(
        ["--run_dirs", str(runs["softmax"]), str(runs["mos"]), "--tokens", "6", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == rows
    # MoS is paired with softmax (same d, seed and test windows): the gaps are plotted.
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "c.md").read_text().splitlines()
    assert page[0].startswith("# Beyond rank") and page[2].startswith("Written by `python ")
    table = page[4 : page.index("", 4)]
    assert len(table) == 2 + len(rows) and table[0].split("|")[1].strip() == "run"
    softmax, mos = rows
    assert softmax["unargmaxable_seconds"] > 0
    assert all(0 < row["gradient_ratio_median"] <= 1 for row in rows)
    # The Transformer presets give mixtures linear latents.
    assert (softmax["head"], mos["head"], mos["latent"]) == ("softmax", "mos", "linear")
    _, vocabulary, model = load_run(str(runs["softmax"]))
    m = len(vocabulary)
    decoder = np.asarray(model.head.decoder[...], np.float64)[:m]
    bias = np.asarray(model.head.bias[...], np.float64)[:m]
    assert softmax["unargmaxable"] == bn.unargmaxable_tokens(decoder, bias).size
    # A plain head's argmax is always an argmaxable token.
    assert softmax["unargmaxable_seen_as_argmax"] == 0
    for row in rows:
        assert 0.0 <= row["unargmaxable_train_share"] <= 1.0
        assert 1 <= row["hidden_size_estimate"] <= min(row["positions"], m)
    # The training sample: every whole window of the smoke corpus's short training stream.
    config, _, _ = load_run(str(runs["softmax"]))
    train = np.asarray(config.data.load(str(runs["softmax"])).train)
    whole = (len(train) - 1) // config.data.bptt * config.data.bptt
    assert softmax["train_nll_by_train_count"]["all"]["positions"] == whole
    headings = [line for line in page if line.startswith("## ")]
    assert headings == ["## Test NLL by the target word's training count",
                        "## Training NLL by the target word's training count",
                        "## Generalization gap by the target word's training count"]  # fmt: skip


def test_a_call_with_no_head_paired_with_softmax_leaves_no_earlier_plot(runs, tmp_path):
    out = tmp_path / "c.json"
    out.with_suffix(".png").write_bytes(b"an earlier call's plot")
    consequences.main(["--run_dirs", str(runs["softmax"]), "--tokens", "6", "--out", str(out)])
    assert out.exists() and not out.with_suffix(".png").exists()


def test_nll_by_train_count_matches_a_direct_computation(runs):
    config, vocabulary, model = load_run(str(runs["mos"]))
    corpus = config.data.load(str(runs["mos"]))
    train, test, bptt = np.asarray(corpus.train), np.asarray(corpus.test), config.data.bptt
    counts = np.bincount(train, minlength=len(vocabulary))
    edges = (2, 3)  # the smoke corpus's training counts are 1 to 3
    groups = consequences.nll_by_train_count(
        model, test, counts, bptt, edges=edges, windows_per_call=2
    )
    assert list(groups) == ["0-1", "2-2", "3+", "all"]
    # Reference: the model's own forward pass window by window, each target sorted by hand.
    nll: dict[str, list[float]] = {name: [] for name in groups}
    for start in range(0, (len(test) - 1) // bptt * bptt, bptt):
        log_probs = np.asarray(model(jnp.asarray(test[None, start : start + bptt])))[0]
        for t, target in enumerate(test[start + 1 : start + bptt + 1]):
            count = counts[target]
            name = "0-1" if count < 2 else "2-2" if count < 3 else "3+"
            for group in (name, "all"):
                nll[group].append(-float(log_probs[t, target]))
    assert sum(len(values) > 0 for values in nll.values()) >= 3  # two groups and "all"
    for name, values in nll.items():
        assert groups[name]["positions"] == len(values)
        if values:
            np.testing.assert_allclose(groups[name]["nll"], np.mean(values), rtol=1e-5)
        else:
            assert groups[name]["nll"] is None
    # positions= keeps the first whole windows: here the first two, as a stream cut after them.
    first = consequences.nll_by_train_count(
        model, test, counts, bptt, positions=2 * bptt + 1, edges=edges
    )
    assert first == consequences.nll_by_train_count(
        model, test[: 2 * bptt + 1], counts, bptt, edges=edges
    )
    assert first["all"]["positions"] == 2 * bptt


def test_nll_by_train_count_refuses_a_test_set_without_a_whole_window(runs):
    _, vocabulary, model = load_run(str(runs["softmax"]))
    counts = np.ones(len(vocabulary), int)
    with pytest.raises(
        UsageError, match="the test set's length 11 holds no whole window of bptt 20"
    ):
        consequences.nll_by_train_count(model, np.arange(11) % len(vocabulary), counts, 20)


def test_count_table_pairs_each_head_with_softmax_at_the_same_d_and_seed():
    def row(run, head, d, seed, nll, positions=(5, 7)):
        groups = {"0-9": {"nll": nll[0], "positions": positions[0]},
                  "10+": {"nll": nll[1], "positions": positions[1]}}  # fmt: skip
        return {"run": run, "head": head, "d": d, "seed": seed, "vocab_size": 50,
                "test_nll_by_train_count": groups}  # fmt: skip

    rows = [
        row("softmax-d8-s1", "softmax", 8, 1, (4.0, 2.0)),
        row("plif-d8-s1", "plif", 8, 1, (3.5, 2.25)),
        row("plif-d8-s2", "plif", 8, 2, (3.0, 2.0)),  # no softmax of seed 2
        row("mos-d8-s1", "mos", 8, 1, (5.0, 1.0), positions=(6, 6)),  # other positions
        {"run": "old", "head": "softmax", "d": 8, "vocab_size": 50},  # measured before
    ]
    lines = consequences.count_table(rows).splitlines()
    assert lines[0] == "## Test NLL by the target word's training count"
    assert "(vocabulary 50: 0-9: 5, 10+: 7; vocabulary 50: 0-9: 6, 10+: 6)." in lines[2]
    body = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[4:]]
    assert body[0] == ["run", "0-9", "10+"]
    assert body[2:] == [
        ["softmax-d8-s1", "4.000", "2.000"],
        ["plif-d8-s1", "3.500 (-0.500)", "2.250 (+0.250)"],
        ["plif-d8-s2", "3.000", "2.000"],
        ["mos-d8-s1", "5.000", "1.000"],
    ]
    assert consequences.count_table(rows[-1:]) == ""


def test_count_table_adds_training_nll_and_the_generalization_gap_where_measured():
    def groups(nll, positions=(5, 7)):
        return {"0-9": {"nll": nll[0], "positions": positions[0]},
                "10+": {"nll": nll[1], "positions": positions[1]}}  # fmt: skip

    def row(run, head, test, train=None, train_positions=(50, 70)):
        r = {"run": run, "head": head, "d": 8, "seed": 1, "vocab_size": 50,
             "test_nll_by_train_count": groups(test)}  # fmt: skip
        if train is not None:
            r["train_nll_by_train_count"] = groups(train, train_positions)
        return r

    rows = [
        row("softmax-d8-s1", "softmax", (6.0, 3.0), (5.0, 2.5)),
        row("mos-d8-s1", "mos", (6.5, 3.0), (4.0, 2.25)),  # fits better, generalizes worse
        row("plif-d8-s1", "plif", (5.5, 3.0), (4.5, 2.5), train_positions=(40, 80)),
        row("old-d8-s1", "sigsoftmax", (6.0, 3.0)),  # measured before the training NLL
    ]
    sections = consequences.count_table(rows).split("\n\n## ")
    assert [s.splitlines()[0].lstrip("# ") for s in sections] == [
        "Test NLL by the target word's training count",
        "Training NLL by the target word's training count",
        "Generalization gap by the target word's training count",
    ]

    def body(section):
        lines = section.splitlines()[4:]
        return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]

    assert body(sections[1]) == [
        ["softmax-d8-s1", "5.000", "2.500"],
        ["mos-d8-s1", "4.000 (-1.000)", "2.250 (-0.250)"],
        ["plif-d8-s1", "4.500", "2.500"],  # another training sample: not paired
    ]
    assert body(sections[2]) == [
        ["softmax-d8-s1", "1.000", "0.500"],
        ["mos-d8-s1", "2.500 (+1.500)", "0.750 (+0.250)"],
        ["plif-d8-s1", "1.000", "0.500"],
    ]


def test_count_gaps_split_each_heads_gap_to_softmax_over_the_groups(tmp_path):
    rng = np.random.default_rng(0)
    positions = {"0-9": 30, "10-99": 50, "100+": 20}

    def row(head, d, seed, nll):
        groups = {
            g: {"nll": v, "positions": positions[g]} for g, v in zip(positions, nll, strict=True)
        }
        total = sum(positions.values())
        mean = sum(positions[g] * v for g, v in zip(positions, nll, strict=True)) / total
        groups["all"] = {"nll": mean, "positions": total}
        return {"run": f"{head}-d{d}-s{seed}", "head": head, "d": d, "seed": seed,
                "vocab_size": 50, "test_nll_by_train_count": groups}  # fmt: skip

    rows = [
        row(head, d, seed, rng.uniform(2, 9, 3))
        for head in ("softmax", "plif", "mos")
        for d in (8, 16)
        for seed in (1, 2)
    ]
    rows.append(row("mos", 32, 1, (5.0, 4.0, 3.0)))  # no softmax at d = 32: left out
    gaps = consequences.count_gaps(rows)
    assert {(e["head"], e["d"]) for e in gaps} == {(h, d) for h in ("plif", "mos") for d in (8, 16)}
    assert {e["seeds"] for e in gaps} == {2}
    total = {r["run"]: r["test_nll_by_train_count"]["all"]["nll"] for r in rows}
    for head in ("plif", "mos"):
        for d in (8, 16):
            want = np.mean(
                [total[f"{head}-d{d}-s{s}"] - total[f"softmax-d{d}-s{s}"] for s in (1, 2)]
            )
            got = sum(e["gap_nats"] for e in gaps if (e["head"], e["d"]) == (head, d))
            np.testing.assert_allclose(got, want, rtol=1e-12)
    (one,) = [e for e in gaps if (e["head"], e["d"], e["group"]) == ("plif", 8, "0-9")]
    nll = {r["run"]: r["test_nll_by_train_count"]["0-9"]["nll"] for r in rows}
    want = np.mean([0.3 * (nll[f"plif-d8-s{s}"] - nll[f"softmax-d8-s{s}"]) for s in (1, 2)])
    np.testing.assert_allclose(one["gap_nats"], want, rtol=1e-12)
    consequences.plot_count_gaps(gaps, tmp_path / "gaps.png")
    assert (tmp_path / "gaps.png").stat().st_size > 0


def test_missing_run_dirs_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        consequences.main([])
    assert exit_info.value.code == 2
    message = "--run_dirs must name at least one run folder (or --merge_from)"
    assert message in plain(capsys.readouterr().err)


def test_rows_measured_before_a_failure_are_kept(runs, tmp_path):
    out = tmp_path / "c.json"
    with pytest.raises(SystemExit) as exit_info:
        consequences.main(
            ["--run_dirs", str(runs["softmax"]), str(tmp_path / "no-such-run"), "--tokens", "6",
             "--out", str(out)]
        )  # fmt: skip
    assert exit_info.value.code != 0
    (row,) = json.loads(out.read_text())
    assert row["run_dir"] == str(runs["softmax"]) and row["head"] == "softmax"
    page = (tmp_path / "c.md").read_text().splitlines()
    table = page[4 : page.index("", 4)]
    assert len(table) == 3 and table[2].split("|")[1].strip() == runs["softmax"].name


def test_merge_keeps_other_runs_rows_and_replaces_a_run_measured_again(runs, tmp_path):
    out = tmp_path / "c.json"
    args = ["--tokens", "6", "--out", str(out)]
    softmax, mos = consequences.main(["--run_dirs", str(runs["softmax"]), str(runs["mos"]), *args])
    assert (softmax["run"], mos["run"]) == (runs["softmax"].name, runs["mos"].name)
    # Marked rows: the one measured again must be replaced, the other kept as it was.
    out.write_text(json.dumps([{**softmax, "unargmaxable": -1}, {**mos, "unargmaxable": -2}]))
    rows = consequences.main(["--merge", "--run_dirs", str(runs["softmax"]), *args])
    assert json.loads(out.read_text()) == rows
    assert [(r["run"], r["unargmaxable"]) for r in rows] == [
        (runs["softmax"].name, softmax["unargmaxable"]),
        (runs["mos"].name, -2),
    ]
    page = (tmp_path / "c.md").read_text().splitlines()
    assert page[4].startswith("Rows gathered call by call") and page.index("", 6) == 6 + 2 + 2
    # Without --merge the file holds this call's rows only.
    (row,) = consequences.main(["--run_dirs", str(runs["mos"]), *args])
    assert [r["run"] for r in json.loads(out.read_text())] == [runs["mos"].name]


def test_fill_missing_measures_only_what_an_earlier_row_lacks(runs, tmp_path, capsys):
    out = tmp_path / "c.json"
    args = ["--tokens", "6", "--out", str(out), "--merge"]
    softmax, mos = consequences.main(["--run_dirs", str(runs["softmax"]), str(runs["mos"]), *args])
    # softmax's row predates the training NLL (and is marked: a field measured again would
    # lose its mark); mos's row lacks nothing.
    old = {k: v for k, v in softmax.items() if k != "train_nll_by_train_count"}
    out.write_text(json.dumps([{**old, "unargmaxable": -1}, mos]))
    rows = consequences.main(
        ["--run_dirs", str(runs["softmax"]), str(runs["mos"]), "--fill_missing", *args]
    )
    assert rows[1] == mos
    assert rows[0] == {**softmax, "unargmaxable": -1, "filled": {"train_nll": rows[0]["commit"]}}
    assert json.loads(out.read_text()) == rows
    with pytest.raises(SystemExit) as exit_info:
        consequences.main(["--run_dirs", str(runs["mos"]), "--fill_missing", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "--fill_missing adds to --out's rows: it needs --merge" in capsys.readouterr().err


def test_merge_from_adds_rows_measured_elsewhere_as_they_are(runs, tmp_path, capsys):
    # Each run measured by its own call (as on another machine), then gathered into one file.
    softmax, mos = (
        consequences.main(["--run_dirs", str(runs[h]), "--tokens", "6", "--out", str(tmp_path / h)])
        for h in ("softmax", "mos")
    )
    out = tmp_path / "all.json"
    out.write_text(json.dumps([{**softmax[0], "unargmaxable": -1}, {**mos[0], "run": "other"}]))
    from_files = ["--merge_from", str(tmp_path / "softmax"), str(tmp_path / "mos")]
    rows = consequences.main(["--merge", "--out", str(out), *from_files])
    assert rows == [softmax[0], {**mos[0], "run": "other"}, mos[0]]
    assert json.loads(out.read_text()) == rows
    page = out.with_suffix(".md").read_text().split("\n\n", 2)[2]
    assert page == consequences.page_body(rows, merge=True).strip() + "\n"
    assert out.with_suffix(".png").exists()  # mos is paired with softmax at the same d and seed
    for args in ([*from_files, "--out", str(out)], ["--merge", *from_files]):
        with pytest.raises(SystemExit) as exit_info:
            consequences.main(args)
        assert exit_info.value.code == 2
        assert "--merge_from adds rows to --out's: it needs --merge and --out" in plain(
            capsys.readouterr().err
        )
    with pytest.raises(SystemExit) as exit_info:
        consequences.main(["--merge", "--out", str(out), "--merge_from", str(tmp_path / "no")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f"--merge_from: {tmp_path / 'no'} does not exist\n")
    (tmp_path / "bad.json").write_text("not json")  # the error names the flag that read it
    with pytest.raises(SystemExit) as exit_info:
        consequences.main(
            ["--merge", "--out", str(out), "--merge_from", str(tmp_path / "bad.json")]
        )
    assert exit_info.value.code == 2
    assert f"error: --merge_from: {tmp_path / 'bad.json'} is not JSON" in capsys.readouterr().err


def test_merge_refuses_a_file_that_is_not_its_rows(runs, tmp_path, capsys):
    out = tmp_path / "c.json"
    for text in ('{"run": "softmax"}', "[1, 2]", "not json"):
        out.write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            consequences.main(["--merge", "--run_dirs", str(runs["softmax"]), "--out", str(out)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.startswith(f"consequences.py: error: --merge: {out} is not")
        assert out.read_text() == text


def test_the_committed_page_is_its_json_s_rows():
    """docs/results/consequences-ptb-transformer.md shows the JSON's rows as the code renders
    them (the grid's hook writes both with the code it was pinned at; a stale page fails)."""
    results = ROOT / "docs" / "results"
    rows = json.loads((results / "consequences-ptb-transformer.json").read_text())
    page = (results / "consequences-ptb-transformer.md").read_text().split("\n\n", 2)
    assert page[0] == f"# {consequences.PAGE_TITLE}" and page[1].startswith("Written by ")
    assert page[2] == consequences.page_body(rows, merge=True).strip() + "\n", (
        "rerun `python experiments/consequences.py --merge --fill_missing --out "
        "docs/results/consequences-ptb-transformer.json --run_dirs RUN` to rewrite the page"
    )
