"""Trained smoke runs of experiments/language_model.py, shared by every test that reads one.

Each run (:data:`SMOKE_RUNS`) is trained once per test session: one epoch of a smoke preset on
the fixture corpus, without the evaluation extras. Under pytest-xdist the first worker to ask
trains it, under a lock in the session's folder that every worker shares, and the others read it.
Tests read these folders; a test that changes a run's files copies the run first.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from experiments import language_model
from tests.script_runs import run_main

SMOKE_RUNS = {
    "awd_softmax": ("smoke",),
    "awd_mos": ("smoke", "--head", "mos"),  # the smoke head: 2 components
    "transformer_softmax": ("transformer-smoke",),
    "transformer_mos": ("transformer-smoke", "--head", "mos"),
}


def train_smoke_run(out: Path, *flags: str) -> Path:
    """One epoch of ``language_model.py FLAGS`` in ``out``, without the evaluation extras (in
    this process: tests/script_runs.py)."""
    flags = (*flags, "--epochs", "1", "--no-dynamic_eval", "--max_logprob_tokens", "0")
    code, _, stderr = run_main(language_model.main, *flags, "--out_dir", str(out))
    assert code == 0, stderr
    return out


def script_env() -> dict[str, str]:
    """A script's environment as a subprocess: the CPU, and what tests/conftest.py put in this
    process's environment (XLA's fast compile mode, the test run's compilation cache)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="session")
def env() -> dict[str, str]:
    """:func:`script_env`, for the tests that run a script."""
    return script_env()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Callable[[str], Path]:
    """``smoke_run(NAME)``: the folder of the trained run ``SMOKE_RUNS[NAME]``."""
    base = tmp_path_factory.getbasetemp()
    # Every xdist worker has its own basetemp inside the session's folder: share that one.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "smoke_runs"
    root.mkdir(exist_ok=True)

    def trained(name: str) -> Path:
        out = root / name
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "results.json").is_file():
                train_smoke_run(out, *SMOKE_RUNS[name])
        return out

    return trained
