"""benchmarks/_timing.py's A/B workers: a worker times the library of the checkout it was started
for, all of it, or stops: where that checkout lacks a module, an editable install of another
checkout would answer for it, and the baseline would be timed partly with this code."""

import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import Worker  # noqa: E402

SCRIPT = f"""
import json
import sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
from _timing import worker_cases
import bottleneck.normalizers  # what the timed case needs
for case in worker_cases():
    print(json.dumps({{"case": case}}), flush=True)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return path


def test_a_worker_answers_with_its_own_checkouts_library(script):
    worker = Worker(ROOT, str(script))
    try:
        assert worker.ask("a@b") == {"case": "a@b"}
    finally:
        worker.close()


def test_a_checkout_without_a_module_the_worker_imports_stops_it(script, tmp_path, capfd):
    old = tmp_path / "old"  # a checkout from before bottleneck/normalizers.py
    (old / "bottleneck").mkdir(parents=True)
    (old / "bottleneck" / "__init__.py").write_text("")
    worker = Worker(old, str(script))
    with pytest.raises(SystemExit, match="a worker died"):
        worker.ask("a@b")
    worker.close()
    err = capfd.readouterr().err
    assert f"the checkout {old} lacks " in err and "bottleneck.normalizers" in err, err


def test_a_worker_runs_with_the_environment_it_is_given(tmp_path):
    # --preload's worker: the same library, another environment (LD_PRELOAD, an allocator).
    path = tmp_path / "env_worker.py"
    path.write_text(
        f"import json, os, sys\nsys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from _timing import worker_cases\n"
        "for case in worker_cases():\n"
        "    print(json.dumps(os.environ.get(case)), flush=True)\n"
    )
    worker = Worker(ROOT, str(path), env={"BOTTLENECK_TEST_SETTING": "on"})
    try:
        assert worker.ask("BOTTLENECK_TEST_SETTING") == "on"
    finally:
        worker.close()


def test_losses_equal_bit_for_bit_or_the_largest_relative_difference():
    from study_step import same_losses

    assert same_losses([1.5, 2.0], [1.5, 2.0]) == "yes"
    assert same_losses([1.5, 2.0 * (1 + 2**-20)], [1.5, 2.0]) == "no (9.5e-07)"
