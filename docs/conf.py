"""Sphinx configuration: the API reference from the docstrings, the guides and results in MyST
Markdown, the tour notebook rendered with its saved outputs (never re-executed here).

Build (warnings are errors):  python -m sphinx -W --keep-going -b html docs docs/_build/html

Sphinx because the docstrings are reStructuredText (``:func:`` roles, ``.. math::``), as optax's
and Flax's are; myst-nb renders Markdown pages and the notebook; furo is the theme.
"""

import inspect
import json
import shutil
import subprocess
from pathlib import Path

import bottleneck

ROOT = Path(__file__).resolve().parents[1]
GENERATED = Path(__file__).resolve().parent / "_generated"


def _with_header(page: Path) -> str:
    """A benchmark's page as its script wrote it; one written before the scripts headed their
    pages (command, commit, machine) gets that header from its JSON and from git."""
    text = page.read_text()
    if "\nWritten by `" in text:
        return text
    title, _, body = text.partition("\n") if text.startswith("# ") else ("", "", text)
    title = title or f"# Benchmark results: `benchmarks/results/{page.name}`"
    record = page.with_suffix(".json")
    machine = json.loads(record.read_text()).get("machine", {}) if record.is_file() else {}
    landed = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", str(page)],
        capture_output=True, text=True, check=False,
    ).stdout.strip() or "unknown"  # fmt: skip
    labels = {"processor": "{}", "cpu_count": "{} cores", "platform": "{}", "jax_version": "JAX {}"}
    where = ", ".join(form.format(machine[k]) for k, form in labels.items() if k in machine)
    header = (
        f"Numbers committed in `{landed}` (written before the scripts recorded their commit); "
        f"machine: {where or 'not recorded'}."
    )
    return f"{title}\n\n{header}\n\n{body.strip()}\n"


# Pages that live elsewhere in the repository are copied in (Sphinx reads only its source
# folder): the tour notebook and the benchmarks' results, as the scripts wrote them.
shutil.rmtree(GENERATED, ignore_errors=True)
(GENERATED / "benchmarks").mkdir(parents=True)
shutil.copy(ROOT / "notebooks" / "tour.ipynb", GENERATED / "tour.ipynb")
for page in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
    (GENERATED / "benchmarks" / page.name).write_text(_with_header(page))

project = "softmax-bottleneck"
release = bottleneck.__version__
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.napoleon",
    "myst_nb",
]
autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of the class: a NamedTuple's members are documented by autodoc already.
napoleon_use_ivar = True
nb_execution_mode = "off"  # the notebook's saved outputs, as tests/test_notebook.py checks them
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
# results/ holds what the scripts wrote: pages of their own, or tables other pages include.
exclude_patterns = [
    "_build",
    "results/*.csv",
    "results/consequences-*.md",  # included by beyond_rank.md
    "results/gradient-bottleneck-*.md",
]
html_theme = "furo"
html_title = "softmax-bottleneck"


def _drop_type_docstrings(app, what, name, obj, options, lines):
    # A module constant (a dict, a tuple, a str) has no docstring of its own, and autodoc would
    # show its type's ("str(object='') -> str ...") as if it were the constant's.
    doc = type(obj).__doc__
    if (
        what in ("data", "attribute")
        and isinstance(doc, str)
        and "\n".join(lines).strip() == inspect.cleandoc(doc)
    ):
        lines.clear()


def setup(app):
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
