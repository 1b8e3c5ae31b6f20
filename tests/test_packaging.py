"""What an install carries: the library and the smoke corpus, not the experiment scripts, which run
from anywhere without the checkout's other files."""

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

import bottleneck
from bottleneck.data import FIXTURES_DIR
from bottleneck.runs import language_model, lm_study
from tests.paths import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
SCRIPTS = sorted(p for p in (ROOT / "experiments").glob("*.py") if p.name != "__init__.py")


def test_the_distribution_holds_the_library_and_no_experiments_package():
    packages = setuptools.find_packages(ROOT, include=SETUPTOOLS["packages"]["find"]["include"])
    assert "bottleneck" in packages and "bottleneck.runs" in packages
    assert not [p for p in packages if p.split(".")[0] != "bottleneck"]
    assert SETUPTOOLS["py-modules"] == ["softmax_bottleneck"]


def test_the_smoke_corpus_is_package_data_the_smoke_presets_read():
    package = Path(bottleneck.__file__).parent / "data"
    patterns = SETUPTOOLS["package-data"]["bottleneck.data"]
    files = [p.relative_to(package).as_posix() for p in FIXTURES_DIR.rglob("*") if p.is_file()]
    assert len(files) == 6
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in patterns) for f in files)
    for config in (language_model.PRESETS["smoke"], lm_study.PRESETS["awd-smoke"].trunk):
        assert Path(config.data.data_dir) == FIXTURES_DIR


def test_the_reports_published_numbers_are_package_data():
    runs = Path(bottleneck.__file__).parent / "runs"
    patterns = SETUPTOOLS["package-data"]["bottleneck.runs"]
    data = [p.name for p in runs.iterdir() if p.suffix == ".json"]
    assert data == ["published_ptb.json"]
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in patterns) for name in data)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_copied_out_of_the_checkout_still_runs(script, tmp_path):
    # Alone in a folder: no sibling script, no tests/ folder to import or read.
    copy = Path(shutil.copy(script, tmp_path))
    process = subprocess.run(
        [sys.executable, str(copy), "--help"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr
    assert process.stdout.startswith(f"usage: {script.name}")
