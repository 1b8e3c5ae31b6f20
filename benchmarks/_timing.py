"""Shared timing helpers for the benchmark scripts.

The main entry point is :func:`time_interleaved`: it runs several zero-argument callables in
turn, repetition after repetition, so that slow drifts of the machine (other processes,
thermal throttling) hit every candidate alike. Compare candidates with :func:`median_ratio`,
the median of per-repetition ratios, which is robust to a noisy repetition that slowed both.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

# The checkout these scripts belong to.
CHECKOUT = Path(__file__).resolve().parents[1]


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    on_call: Callable[[int], object] | None = None,
) -> dict[str, list[float]]:
    """Wall-clock milliseconds of each callable, measured in interleaved repetitions.

    Each callable is first called ``warmup`` times (this is where jit compiles), then each
    repetition calls every callable once; the order flips on odd repetitions so that no
    candidate always runs right after the same neighbour. Results are waited for with
    ``jax.block_until_ready`` inside the timed region.

    Args:
      fns: name -> zero-argument callable returning JAX arrays (or any pytree of them).
      repeats: number of timed repetitions.
      warmup: untimed calls of each callable before timing.
      on_call: called with 1 after every call, warm-up included (e.g. ``tqdm.update``).

    Returns:
      name -> ``repeats`` timings in milliseconds, in repetition order, so that
      ``times[a][i]`` and ``times[b][i]`` come from the same repetition.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
            if on_call is not None:
                on_call(1)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for repetition in range(repeats):
        for name in names if repetition % 2 == 0 else reversed(names):
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(1e3 * (time.perf_counter() - start))
            if on_call is not None:
                on_call(1)
    return times


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over repetitions of ``numerator[i] / denominator[i]``."""
    if len(numerator) != len(denominator):
        raise ValueError(f"got {len(numerator)} and {len(denominator)} timings")
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))


def medians(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Median milliseconds of each named timing list."""
    return {name: statistics.median(values) for name, values in times.items()}


def machine_info() -> dict[str, Any]:
    """Where the numbers come from: OS/CPU, core count, Python, JAX version, backend and the
    devices' kind (e.g. ``NVIDIA H200``)."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(device) for device in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; floats are shown with one decimal, other cells with ``str``."""

    def cell(value: object) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(
    path: str | Path, payload: Mapping[str, Any], markdown: str, *, commit: str | None = None
) -> None:
    """Writes ``payload`` as indented JSON to ``path`` and ``markdown`` beside it (``.md``).

    The JSON records the code's commit; the Markdown becomes a results page
    (:func:`bottleneck.train.results_page`: command, commit and machine under the title), its
    title the first line of ``markdown`` when that is a ``# `` heading, else the file's name.
    ``commit``: the measured code's, where this process did not run it (worker processes of
    another checkout); by default the commit of the ``bottleneck`` this process imported, which
    a warning names when it is not this script's checkout (an editable install of another
    checkout comes first on ``sys.path``: set ``PYTHONPATH`` to this checkout's root).
    """
    # Imported here, not above: a worker of another checkout imports none of this plumbing
    # (worker_cases checks that every bottleneck module it holds is that checkout's).
    import bottleneck
    from bottleneck.runs import code_commit, results_page, rows

    path = Path(path)
    if commit is None:
        commit = code_commit()
        library = Path(bottleneck.__file__).resolve().parents[1]
        if library != CHECKOUT:
            print(
                f"warning: this ran the bottleneck of {library} ({commit}), not of {CHECKOUT}: "
                f"the page names that code; PYTHONPATH={CHECKOUT} times this checkout's",
                file=sys.stderr,
            )
    rows.write_json(path, {**payload, "commit": commit})
    first, _, rest = markdown.partition("\n")
    title, body = (
        (first[2:], rest)
        if first.startswith("# ")
        else (f"Benchmark results: `benchmarks/results/{path.with_suffix('.md').name}`", markdown)
    )
    path.with_suffix(".md").write_text(results_page(title, body, commit=commit))


class Worker:
    """``python SCRIPT --worker ARGS...`` with the library of the checkout at ``root``.

    The A/B benchmarks time two versions of the code in one run: a package cannot be imported
    twice in one process, so each version answers in a process of its own (``PYTHONPATH=root``)
    while the parent interleaves the calls. ``env`` is added to the worker's environment, e.g.
    ``{"LD_PRELOAD": "libtcmalloc_minimal.so.4"}`` to time one library under two memory
    allocators. The protocol: the parent writes one case per line; the worker answers each with
    one JSON line.
    """

    def __init__(
        self, root: Path, script: str, *args: object, env: Mapping[str, str] | None = None
    ):
        path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **(env or {}), "PYTHONPATH": path, WORKER_LIBRARY: str(root)}
        self.process = subprocess.Popen(
            [sys.executable, script, "--worker", *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def ask(self, case: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(case + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it died before this case (at its imports, or the last case)
            raise SystemExit(f"a worker died before {case} (its error is above)") from None
        answer = self.process.stdout.readline()
        if not answer:
            raise SystemExit(f"a worker died on {case} (its error is above)")
        return json.loads(answer)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


# The environment variable naming the checkout whose library a worker must run.
WORKER_LIBRARY = "BOTTLENECK_BENCHMARK_LIBRARY"


def foreign_modules(root: Path) -> list[str]:
    """The ``bottleneck`` modules this process holds from elsewhere than the checkout ``root``.

    Where ``root`` lacks a module, Python does not stop: an editable install of another
    checkout (this one's, typically) answers for it, so a baseline would be timed partly with
    this code."""
    root = root.resolve()
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if (name == "bottleneck" or name.startswith("bottleneck."))
        and getattr(module, "__file__", None)
        and not Path(module.__file__).resolve().is_relative_to(root)
    )


def worker_cases() -> Iterator[str]:
    """A worker's cases, one stdin line each; before each, a check that every ``bottleneck``
    module the worker has imported (its cases' included) is the checkout's it was started for
    (:class:`Worker`), else it stops with the modules that checkout lacks."""
    root = Path(os.environ[WORKER_LIBRARY])
    for line in sys.stdin:
        foreign = foreign_modules(root)
        if foreign:
            raise SystemExit(
                f"the checkout {root} lacks {', '.join(foreign)}, which this benchmark's worker "
                "imports (another checkout's copy answered for them): time it against a "
                "checkout that has them"
            )
        yield line.strip()


def commit_of(root: Path) -> str:
    """The commit of the checkout at ``root`` (``-dirty`` with uncommitted code), or ``unknown``
    when ``root`` is not the top of a git checkout (a copy, e.g. ``git archive``)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    if Path(git("rev-parse", "--show-toplevel") or "/nonexistent").resolve() != root.resolve():
        return "unknown"
    # Results written beside the scripts are not code.
    code = ("bottleneck", "experiments", "benchmarks", ":!benchmarks/results")
    dirty = git("status", "--porcelain", "--", *code)
    return git("rev-parse", "--short=12", "HEAD") + ("-dirty" if dirty else "")
