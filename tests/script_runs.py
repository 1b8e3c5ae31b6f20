"""An experiment script's ``main`` run in the test's own process, read as its command line.

A subprocess pays for its imports on every call (3-6 s of CPU for JAX, Flax, Orbax, TFDS and a
script's own, on a 2-core AMD EPYC), more than a smoke run trains. Tests that read what a
script wrote and printed call its ``main`` here instead; those about the process itself (signals,
a script copied out of the checkout, pipes) keep their subprocess.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from typing import Any

import jax


def run_main(main: Callable[[list[str]], Any], *args: str) -> tuple[int, str, str]:
    """``main(args)`` as ``python SCRIPT ARGS`` would run it: the exit status (0 on return,
    else ``SystemExit``'s), and what it printed on stdout and stderr (progress bars and log
    lines included). Another exception propagates, where a subprocess would print its
    traceback and exit 1. A child process of the script (``--after_cell``'s hook) writes to
    this process's own descriptors, not into the strings.

    JAX's dtype promotion is its default, as in a user's run: the suite's strict promotion
    (tests/conftest.py) is for the library's own code, and optax's Adam raises a float to an
    int32 count power."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with (
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
        jax.numpy_dtype_promotion("standard"),
    ):
        try:
            main(list(args))
        except SystemExit as exit_:  # as the interpreter ends: a message is printed, status 1
            if isinstance(exit_.code, int) or exit_.code is None:
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
    return code, stdout.getvalue(), stderr.getvalue()
