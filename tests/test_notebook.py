"""notebooks/tour.ipynb runs top to bottom, and the outputs saved in it come from the current code.

The notebook is executed once per session (``executed``, ~30-60 s on 2 CPU cores) in a fresh
kernel, as ``python notebooks/execute.py`` does. Cells tagged ``check`` print only numbers that
do not move between x86 CPUs (integer ranks and counts, values rounded well away from a rounding
edge); their saved text must equal the fresh run's, so a change that moves them fails here until
the notebook is re-executed and committed.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import sys
import time
from pathlib import Path

import nbformat
import pytest

import bottleneck
from tests.paths import ROOT

NOTEBOOK = ROOT / "notebooks" / "tour.ipynb"
CHECK_TAG = "check"
# What the notebook may import: the public library, its numerical stack, and the stdlib.
ALLOWED_IMPORTS = {"numpy", "jax", "optax", "flax", "matplotlib"} | set(sys.stdlib_module_names)
PUBLIC_PACKAGES = ("bottleneck.nn", "bottleneck.data")


def _load_execute_module():
    spec = importlib.util.spec_from_file_location(
        "notebook_execute", NOTEBOOK.parent / "execute.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


notebook_execute = _load_execute_module()


def code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def printed_text(cell: nbformat.NotebookNode) -> str:
    """What a cell printed to stdout and its result's text, joined across output messages."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream" and output.name == "stdout":
            parts.append(output.text)
        elif output.output_type == "execute_result":
            parts.append(output.data.get("text/plain", ""))
    return "".join(parts)


def output_kinds(cell: nbformat.NotebookNode) -> list[str]:
    """Each output's type and MIME types (or stream name), e.g. ``display_data:image/png,text/plain``.

    Consecutive outputs of one stream count once: the kernel flushes stdout in as many pieces
    as its timing gives (one ``print`` after a slow step can arrive as a second piece).
    """
    kinds = []
    for output in cell.outputs:
        detail = output.get("name") or ",".join(sorted(output.get("data", {})))
        kind = f"{output.output_type}:{detail}"
        if not (output.output_type == "stream" and kinds and kinds[-1] == kind):
            kinds.append(kind)
    return kinds


def tagged(cell: nbformat.NotebookNode, tag: str) -> bool:
    return tag in cell.get("metadata", {}).get("tags", [])


@pytest.fixture(scope="module")
def committed() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK, as_version=4)


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> tuple[nbformat.NotebookNode, Path]:
    """The notebook freshly executed (any cell error fails here), and the kernel's working dir."""
    cwd = tmp_path_factory.mktemp("notebook_cwd")
    start = time.perf_counter()
    notebook = notebook_execute.execute(NOTEBOOK, cwd)
    print(f"\nnotebooks/tour.ipynb executed in {time.perf_counter() - start:.1f} s")
    return notebook, cwd


def test_notebook_runs_and_writes_nothing(executed):
    notebook, cwd = executed
    assert code_cells(notebook), "the notebook has no code cells"
    assert not any(cwd.iterdir()), f"the notebook wrote {sorted(p.name for p in cwd.iterdir())}"


def test_check_cells_print_what_is_saved(committed, executed):
    fresh, _ = executed
    saved_cells, fresh_cells = code_cells(committed), code_cells(fresh)
    assert [c.source for c in saved_cells] == [c.source for c in fresh_cells]
    checks = [
        (saved, new)
        for saved, new in zip(saved_cells, fresh_cells, strict=True)
        if tagged(saved, CHECK_TAG)
    ]
    assert len(checks) >= 5, "the notebook's tour should check its printed numbers in each step"
    for saved, new in checks:
        assert printed_text(new), f"check cell prints nothing:\n{new.source}"
        assert printed_text(saved) == printed_text(new), (
            f"saved output of this cell is stale; re-run `python notebooks/execute.py`:\n"
            f"{saved.source}"
        )


def test_saved_notebook_was_executed_in_order(committed, executed):
    """Every code cell ran, once, top to bottom, and shows what a fresh run shows (figures too)."""
    fresh, _ = executed
    saved_cells = code_cells(committed)
    counts = [cell.execution_count for cell in saved_cells]
    assert counts == list(range(1, len(saved_cells) + 1)), f"execution counts {counts}"
    for saved, new in zip(saved_cells, code_cells(fresh), strict=True):
        assert output_kinds(saved) == output_kinds(new), f"outputs differ in kind:\n{saved.source}"
        assert not any(o.output_type == "error" for o in saved.outputs)


def test_readme_figure_is_the_saved_notebooks(committed):
    """docs/tour_plif.png, which the documentation's front page shows, is the PNG saved in the notebook."""
    for tag, target in notebook_execute.EXPORTS.items():
        assert target.read_bytes() == notebook_execute.tagged_png(committed, tag), (
            f"{target.relative_to(ROOT)} is not the notebook's; run `python notebooks/execute.py`"
        )


def test_notebook_imports_only_the_public_api(committed):
    imported = set()
    for cell in code_cells(committed):
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"relative import in the notebook: {ast.unparse(node)}"
                imported.add(node.module)
                if node.module == "bottleneck":  # `from bottleneck import nn` imports a module
                    imported.update(
                        f"bottleneck.{alias.name}"
                        for alias in node.names
                        if alias.name not in bottleneck.__all__
                    )
    assert imported, "no imports found"
    for name in imported:
        if name.split(".")[0] == "bottleneck":
            # The top-level API, bottleneck.nn and bottleneck.data (with its public modules, e.g.
            # bottleneck.data.synthetic): never experiments/, the training plumbing or a private
            # module.
            public = name == "bottleneck" or any(
                name == p or name.startswith(p + ".") for p in PUBLIC_PACKAGES
            )
            assert public and not any(part.startswith("_") for part in name.split(".")), name
        else:
            assert name.split(".")[0] in ALLOWED_IMPORTS, f"the notebook imports {name}"


def test_notebook_is_small(committed):
    size = NOTEBOOK.stat().st_size
    assert size < 1_000_000, f"notebooks/tour.ipynb is {size / 1e6:.1f} MB; lower the figures' dpi"
    for cell in code_cells(committed):
        for output in cell.outputs:
            if "image/png" in output.get("data", {}):
                assert len(base64.b64decode(output.data["image/png"])) < 150_000
