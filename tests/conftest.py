"""Test-wide JAX settings: strict dtype promotion catches silent up/down-casts (as equinox does);
one persistent compilation cache for the whole run."""

import os
import shutil
import tempfile

from tests.compile_flags import with_fast_compile

# LAPACK (SVD) runs on OpenBLAS threads that fight XLA's own on small CPUs: 10-200x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# No test downloads a corpus from the release hosts: a run given no data folder would try to.
# A loopback port on which nothing listens makes such an attempt fail at once, with the error
# that tells an offline user what to do (tests of the download serve their own mirror).
os.environ["BOTTLENECK_DATA_URL"] = "http://127.0.0.1:9"

# The suite compiles far more than it computes: XLA's cheapest compiles (tests/compile_flags.py).
# Subprocesses inherit them.
os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))

# Tests compile the same programs many times over: every smoke run, grid cell and seed builds its
# model afresh, in this process or in a subprocess, and jit's in-memory cache keys on the Python
# function, not on the program. JAX's persistent cache keys on the program (with XLA_FLAGS and
# the backend), so each is compiled once per test run: the folder is made by the first process
# (pytest, or xdist's controller) and inherited through the environment by the xdist workers and
# by every subprocess a test starts; its maker removes it at the end. A folder the caller set is
# used as it is.
_OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="bottleneck-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


# Files that hold one long fixture or subprocess (minutes on 2 cores) start first, so that under
# pytest-xdist (--dist loadfile) they overlap the many short files instead of ending the run.
LONG_FIRST = (
    "test_sharding.py",
    "test_lm_study.py",
    "test_notebook.py",
    "test_language_model.py",
    "test_synthetic_experiment.py",
    "test_heads.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.name
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: the order within each file is kept


def pytest_unconfigure(config):
    if _OWN_COMPILATION_CACHE is not None:
        shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)
