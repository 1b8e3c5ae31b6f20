"""README and the guides: their Python runs as written, their numbers are the committed results.

The results files under docs/results/ are what the scripts wrote; the README quotes a few of their
numbers, and a slice of the synthetic study is rerun here against its committed file.
"""

import csv
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from tests.compile_flags import without_fast_compile
from tests.paths import ROOT

README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"
PAGES = [README, *sorted((ROOT / "docs" / "guides").glob("*.md")), ROOT / "docs" / "beyond_rank.md"]


def _python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


# Pages whose Python blocks a reader pastes: each page runs top to bottom in a namespace of its
# own, and each of the README's blocks alone.
@pytest.mark.parametrize(
    "page", [p for p in PAGES if _python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_python_blocks_run(page):
    namespace = {}
    # A reader runs them with JAX's default promotion, not the suite's strict one (conftest.py),
    # which optax's Adam does not support (its bias correction raises a float to an int32 power).
    with jax.numpy_dtype_promotion("standard"):
        for block in _python_blocks(page):
            # The README's snippets are pasted one at a time: each has its own imports.
            exec(compile(block, str(page), "exec"), {} if page == README else namespace)


def test_every_relative_link_of_the_readme_and_guides_exists():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def _synthetic_summary() -> dict[tuple[int, str], dict]:
    summary = json.loads((RESULTS / "synthetic.json").read_text())["summary"]
    return {(row["d"], row["head"]): row for row in summary}


def test_readme_synthetic_table_is_the_committed_results():
    """README's d = 4 rows are the committed summary's mean ± std over seeds, as the script
    writes them (`synthetic.mean_std_text`)."""
    from experiments import synthetic

    cell = r"([\d.]+ ± [\d.]+)"
    rows = re.findall(
        rf"^\| ([a-z_]+) \| {cell} \| {cell} \| {cell} \| {cell} \|$",
        README.read_text(),
        flags=re.M,
    )
    summary = _synthetic_summary()
    assert len(rows) == 7, "README's table should have one row per head at d = 4"
    for head, *cells in rows:
        row = summary[(4, head)]
        assert row["seeds"] == 3, head
        metrics = ("mode_matching", "cross_entropy", "kl", "numerical_rank")
        assert cells == [synthetic.mean_std_text(row, m) for m in metrics], head


def test_readme_beyond_rank_counts_are_the_committed_results():
    rows = {
        r["head"]: r
        for r in json.loads((RESULTS / "consequences-ptb-transformer.json").read_text())
        if r["run"].endswith("-d16-s1")
    }
    text = " ".join(README.read_text().split())
    assert f"softmax leaves {rows['softmax']['unargmaxable']:,} of PTB's words" in text
    assert rows["softmax"]["hidden_size_estimate"] == rows["softmax"]["d"] == 16
    assert "not from sigsoftmax's, PLIF's, MoS's or Mixtape's" in text
    assert all(
        rows[h]["hidden_size_estimate"] > 16 for h in ("sigsoftmax", "plif", "mos", "mixtape")
    )


def test_readme_rare_word_shares_are_the_committed_results():
    rows = {
        r["head"]: r["test_nll_by_train_count"]
        for r in json.loads((RESULTS / "consequences-ptb-transformer.json").read_text())
        if r["run"].endswith("-d128-s1") and "test_nll_by_train_count" in r
    }
    softmax, rare = rows["softmax"], ("0-9", "10-99")

    def rare_share(head: str) -> float:  # of the head's deficit in total test NLL
        def excess(group: str) -> float:
            return rows[head][group]["positions"] * (
                rows[head][group]["nll"] - softmax[group]["nll"]
            )

        return sum(excess(g) for g in rare) / excess("all")

    text = " ".join(README.read_text().split())
    trailing = ("sigsoftmax", "plif", "mos", "mixtape")
    assert all(rows[h]["all"]["nll"] > softmax["all"]["nll"] for h in trailing)
    assert f"{rare_share('sigsoftmax'):.0%} of sigsoftmax's deficit" in text
    assert f"{rare_share('mixtape'):.0%} of Mixtape's" in text
    assert min(rare_share("plif"), rare_share("mos")) >= 1  # "all of PLIF's and MoS's"
    positions = sum(softmax[g]["positions"] for g in rare) / softmax["all"]["positions"]
    nll = sum(softmax[g]["positions"] * softmax[g]["nll"] for g in rare) / (
        softmax["all"]["positions"] * softmax["all"]["nll"]
    )
    assert f"they are {positions:.0%} of the test positions but {nll:.0%} of softmax's" in text


def test_readme_rare_word_share_between_softmax_seeds_is_the_committed_results():
    """The same share of the gap between two of softmax's own seeds at d = 128: its range."""
    rows = {
        r["run"]: r["test_nll_by_train_count"]
        for r in json.loads((RESULTS / "consequences-ptb-transformer.json").read_text())
        if "test_nll_by_train_count" in r
    }
    seeds = [rows[f"softmax-d128-s{s}"] for s in (1, 2, 3)]
    shares = []
    for worse in seeds:
        for better in seeds:
            gap = {g: worse[g]["positions"] * (worse[g]["nll"] - better[g]["nll"]) for g in worse}
            if gap["all"] > 0:
                shares.append((gap["0-9"] + gap["10-99"]) / gap["all"])
    assert len(shares) == 3
    text = " ".join(README.read_text().split())
    assert f"they hold {100 * min(shares):.0f}–{100 * max(shares):.0f}% of the gap" in text


def test_readme_gradient_share_is_the_committed_results():
    """The measured ||Pg||/||g|| at d = 16 (every head and seed) and sqrt(d/M)."""
    ratios = [
        r["gradient_ratio_median"]
        for r in json.loads((RESULTS / "consequences-ptb-transformer.json").read_text())
        if r["d"] == 16 and r.get("gradient_ratio_median") is not None
    ]
    text = " ".join(README.read_text().split())
    assert f"{100 * min(ratios):.1f}–{100 * max(ratios):.1f}% of the loss gradient's norm" in text
    assert f"sqrt(d/M) = {100 * (16 / 10_000) ** 0.5:.1f}%" in text


def _train_test_gaps(run: str) -> tuple[float, float]:
    """A cell's training and test NLL on the words seen 0-9 times, minus softmax's (same d, seed)."""
    rows = {
        r["run"]: r for r in json.loads((RESULTS / "consequences-ptb-transformer.json").read_text())
    }
    softmax = re.sub(r"^[a-z_]+-", "softmax-", run)
    return tuple(
        rows[run][key]["0-9"]["nll"] - rows[softmax][key]["0-9"]["nll"]
        for key in ("train_nll_by_train_count", "test_nll_by_train_count")
    )


def test_beyond_rank_train_and_test_table_is_the_committed_results():
    lines = (ROOT / "docs" / "beyond_rank.md").read_text().splitlines()
    start = lines.index(
        "| head | d = 16 (s2): train / test | d = 32 (s2) | d = 64 (s2) | d = 128 (s1) "
        "| d = 128 (s2) |"
    )
    cells = {"d16-s2": 1, "d32-s2": 2, "d64-s2": 3, "d128-s1": 4, "d128-s2": 5}
    names = {"sigsoftmax": "sigsoftmax", "PLIF": "plif", "MoS": "mos", "Mixtape": "mixtape"}
    rows = [line.split("|")[1:-1] for line in lines[start + 2 : start + 6]]
    assert [r[0].strip() for r in rows] == list(names)
    for row in rows:
        for cell, column in cells.items():
            train, test = _train_test_gaps(f"{names[row[0].strip()]}-{cell}")
            want = f"{train:+.2f} / {test:+.2f}".replace("-", "−")
            assert row[column].strip() == want.replace("−0.00", "+0.00"), (row[0], cell)


def test_guide_says_every_cell_converged_only_while_every_row_has():
    """A row that lands unconverged (the grid commits rows as they land) turns this red until
    the language-model guide's status stops saying otherwise."""
    with open(RESULTS / "ptb-transformer.csv", newline="") as f:
        converged = [r["converged"] == "True" for r in csv.DictReader(f)]
    text = " ".join((ROOT / "docs" / "guides" / "language_models.md").read_text().split())
    assert converged and ("Every cell is converged" in text) == all(converged)


@pytest.mark.parametrize(
    ("page", "report"),
    [
        (README, "ptb-transformer-fixed.md"),  # the README reads the fixed-trunk grid
        (ROOT / "docs" / "guides" / "language_models.md", "ptb-transformer.md"),  # the earlier
    ],
    ids=["README", "language_models.md"],
)
def test_pages_call_the_study_partial_while_its_report_does(page, report):
    """A report's title ends in "partial" while cells are pending; the page that reads it must
    follow (the README then gives its converged table)."""
    partial = (RESULTS / report).read_text().splitlines()[0].endswith("— partial")
    assert ("**Status: partial.**" in page.read_text()) == partial, page.name


def test_readme_converged_table_is_the_report_s():
    """Once the grid is complete the README's language-model table is its report's head x d
    grid (softmax's test perplexity, each head's gain over it with its interval, the published
    gains) as written."""
    report = (RESULTS / "ptb-transformer-fixed.md").read_text()
    lines = README.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("| softmax (test ppl) ")]
    partial = report.splitlines()[0].endswith("— partial")
    assert len(starts) == (0 if partial else 1)
    if starts:
        table = lines[starts[0] - 2 : starts[0] + 5]
        assert table[0].startswith("| head ") and "published (PTB)" in table[0]
        assert "\n".join(table) + "\n" in report, "README's table is not the report's"


def _language_model_section() -> str:
    text = README.read_text()
    start = text.index("## Language models")
    return " ".join(text[start : text.index("\n## ", start + 1)].split()).replace("−", "-")


def _holm_p(report: str, d: int, head: str, interval: str) -> float:
    """The Holm-corrected p of a head's gain at d whose interval is ``interval``, from the
    report's statistics table."""
    row = re.search(
        rf"^\|\s+{d} \| {head}\s+\|[^|]+\| {re.escape(interval)}\s+\| [\d.]+\s+\| ([\d.]+)",
        report,
        flags=re.M,
    )
    assert row, (d, head, interval)
    return float(row[1])


def test_readme_language_model_numbers_are_the_reports():
    """Each interval the README's language-model reading quotes after its table is one its
    report prints, and each "after Holm" or "not after Holm" beside a gain is the report's
    corrected p; so are the design's spread, detectable gain and seeds, and each trend's
    slope with its interval and reading."""
    section = _language_model_section().split("| mixtape ")[-1]  # the table: tested above
    reading = section[: section.index("Beyond rank")]
    report = (RESULTS / "ptb-transformer-fixed.md").read_text()
    quoted = re.findall(r"\[[+-]\d+\.\d+, [+-]\d+\.\d+\]", reading)
    assert len(quoted) >= 10
    for interval in quoted:
        assert interval in report, interval
    # "<interval> at d = <d>" names a head's comparison: its Holm reading, where one is given
    heads = {"sigsoftmax": "sigsoftmax", "PLIF": "plif", "MoS": "mos", "Mixtape": "mixtape"}
    claims = 0
    for bullet in reading.split(" - "):
        named = [h for h in heads if bullet.lstrip("*").lower().startswith(h.lower())]
        for claim in re.finditer(r"(\[[^]]+\])%? at d = (\d+) \((not )?after Holm\)", bullet):
            (head,) = named
            holm_p = _holm_p(report, int(claim[2]), heads[head], claim[1])
            assert (holm_p < 0.05) == (claim[3] is None), claim[0]
            claims += 1
    assert claims >= 5, "the reading names no gain's Holm reading"
    power = re.search(r"spread \((\d+\.\d+) points\) the design detects (\d+\.\d+) points", reading)
    assert power and f"| {power[1]} " in report and f"| {power[2]} " in report
    seeds = re.search(r"needs (\d+) seeds for 1 point", reading)
    assert seeds and re.search(rf"\| median over all comparisons .*\| {seeds[1]}\s+\|", report)
    per_doubling = reading[reading.index("per doubling") : reading.index("The earlier grid")]
    trends = re.findall(
        r"(sigsoftmax|PLIF|MoS|Mixtape) ([+-]?\d+\.\d+) (\[[^]]+\])( \(after Holm\))?", per_doubling
    )
    assert len(trends) == 4
    for head, slope, interval, after_holm in trends:
        row = re.search(
            rf"\| {heads[head]}\s+\| {slope}\s+\| {re.escape(interval)}\s+\| [\d.]+\s+\| ([\d.]+)",
            report,
        )
        assert row, (head, slope, interval)
        # the trends of the clause that ends in "none detectable" span 0, the others exclude
        # it; "(after Holm)" only where the corrected p is below 0.05
        low, high = (float(v) for v in interval.strip("[]").split(", "))
        undetected = per_doubling.split("none detectable")[0].rsplit(";", 1)[-1]
        excluded = "none detectable" not in per_doubling or interval not in undetected
        assert excluded == (high < 0 or low > 0), (head, interval)
        assert bool(after_holm) == (excluded and float(row[1]) < 0.05), (head, row[1])


def test_committed_synthetic_results_are_what_the_code_computes(tmp_path):
    """A slice of the committed study (d = 4, softmax and PLIF, seed 0), rerun with the code.

    Each (head, d) of the study trains on its own (the task depends on alpha and seed only), so the
    slice reproduces those rows of the full run, bit for bit on the machine that made the file:
    the slice compiles as the full run did (without the suite's fast-compile flags: -O0's other fused
    arithmetic moved PLIF's mode matching by 5 contexts). Tolerances for another CPU: mode
    matching to as many contexts of 256 as this run has near-tied modes (at least one): an argmax
    whose true mode's learned log-probability lies within 0.05 nats of another outcome's may
    flip with another summation order (3 of PLIF's 10 did between two machines);
    cross-entropy and KL to 2e-3 nats (1000 Adam steps carry float32 round-off that far at
    most), the numerical rank exactly (it is d + 2 for softmax and full for PLIF, far from the
    threshold), the effective rank within 1.
    """
    runs = json.loads((RESULTS / "synthetic.json").read_text())["runs"]
    expected = {(r["d"], r["head"]): r for r in runs if r["seed"] == 0}
    out = tmp_path / "synthetic"
    flags = without_fast_compile(os.environ.get("XLA_FLAGS", ""))
    subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "synthetic.py"), "--dims", "4",
         "--heads", "softmax", "plif", "--seeds", "0", "--out_dir", str(out)],
        check=True, capture_output=True, cwd=ROOT, timeout=600,
        env={**os.environ, "XLA_FLAGS": flags.strip()},
    )  # fmt: skip
    summary = json.loads((out / "results.json").read_text())["runs"]
    assert {(row["d"], row["head"]) for row in summary} == {(4, "softmax"), (4, "plif")}
    for row in summary:
        committed = expected[(row["d"], row["head"])]
        flippable = max(1, row["near_tied_modes"])
        assert abs(row["mode_matching"] - committed["mode_matching"]) <= 100 * flippable / 256
        assert abs(row["cross_entropy"] - committed["cross_entropy"]) <= 2e-3, row
        assert abs(row["kl"] - committed["kl"]) <= 2e-3, row
        assert row["numerical_rank"] == committed["numerical_rank"], row
        assert abs(row["effective_rank"] - committed["effective_rank"]) <= 1, row
