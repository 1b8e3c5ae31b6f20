"""Re-execute ``notebooks/tour.ipynb`` in place and refresh its figure, docs/tour_plif.png.

    python notebooks/execute.py

The notebook runs top to bottom in a fresh kernel, on CPU, with this checkout's ``bottleneck``
and a temporary working directory; the executed notebook (outputs included) is written back
and the PNG of the cell tagged ``readme-figure`` is written to ``docs/tour_plif.png``.
``tests/test_notebook.py`` executes it the same way (:func:`execute`) and compares the outputs
of the cells tagged ``check`` with the saved ones, so run this after any change that moves them.
"""

from __future__ import annotations

import base64
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "tour.ipynb"
# Cell tag -> file that receives that cell's PNG output.
EXPORTS = {"readme-figure": ROOT / "docs" / "tour_plif.png"}
CELL_TIMEOUT_S = 300


def kernel_env() -> dict[str, str]:
    """The kernel's environment: this checkout first on the path, CPU, JAX's default promotion."""
    env = dict(os.environ)
    # An installed bottleneck (e.g. another checkout, editable) must not shadow this one.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # The saved outputs come from a CPU; an accelerator would print other round-off.
    env["JAX_PLATFORMS"] = "cpu"
    # Whatever the caller runs under (the test suite is strict), a reader runs JAX's default.
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "standard"
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A non-interactive backend from the caller (MPLBACKEND=Agg) would drop the figures.
    env.pop("MPLBACKEND", None)
    return env


def execute(path: Path = NOTEBOOK, cwd: str | Path | None = None) -> nbformat.NotebookNode:
    """Runs the notebook at ``path`` in a new kernel whose working directory is ``cwd``.

    The kernel is this Python interpreter. Raises ``nbclient.exceptions.CellExecutionError`` on
    the first cell that fails. Returns the executed notebook; the file at ``path`` is not changed.
    """
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as scratch:
        # A kernel spec of our own: a "python3" kernel installed for the user may be another
        # interpreter, without this environment's packages.
        kernels = Path(scratch) / "kernels"
        write_kernel_spec(kernels / "python3")
        kernel_manager = KernelManager(
            kernel_name="python3",
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]),
        )
        default_cwd = Path(scratch) / "cwd"
        default_cwd.mkdir()
        client = NotebookClient(
            notebook,
            km=kernel_manager,
            timeout=CELL_TIMEOUT_S,
            resources={"metadata": {"path": str(cwd or default_cwd)}},
            # Per-cell timings would change the file on every run.
            record_timing=False,
        )
        client.execute(env=kernel_env())
    return notebook


def tagged_png(notebook: nbformat.NotebookNode, tag: str) -> bytes:
    """The PNG output of the one code cell tagged ``tag``."""
    cells = [c for c in notebook.cells if tag in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"expected one cell tagged {tag!r}, found {len(cells)}")
    images = [o["data"]["image/png"] for o in cells[0].outputs if "image/png" in o.get("data", {})]
    if len(images) != 1:
        raise ValueError(f"the cell tagged {tag!r} must show one PNG, it shows {len(images)}")
    return base64.b64decode(images[0])


def main() -> None:
    start = time.perf_counter()
    notebook = execute(NOTEBOOK)
    seconds = time.perf_counter() - start
    nbformat.write(notebook, NOTEBOOK)
    for tag, target in EXPORTS.items():
        target.write_bytes(tagged_png(notebook, tag))
    written = ", ".join(str(p.relative_to(ROOT)) for p in [NOTEBOOK, *EXPORTS.values()])
    print(f"executed in {seconds:.1f} s; wrote {written}", file=sys.stderr)


if __name__ == "__main__":
    main()
