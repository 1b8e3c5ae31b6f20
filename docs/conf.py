"""Sphinx configuration: the API reference from the docstrings, the guides and results in MyST
Markdown, the tour notebook rendered with its saved outputs (never re-executed here).

Build (warnings are errors):  python -m sphinx -W --keep-going -b html docs docs/_build/html

Sphinx because the docstrings are reStructuredText (``:func:`` roles, ``.. math::``), as optax's
and Flax's are; myst-nb renders Markdown pages and the notebook; furo is the theme.
"""

import inspect
import shutil
from pathlib import Path

import bottleneck

ROOT = Path(__file__).resolve().parents[1]
GENERATED = Path(__file__).resolve().parent / "_generated"

# Pages that live elsewhere in the repository are copied in (Sphinx reads only its source
# folder): the tour notebook and the benchmarks' results, as the scripts wrote them.
shutil.rmtree(GENERATED, ignore_errors=True)
(GENERATED / "benchmarks").mkdir(parents=True)
shutil.copy(ROOT / "notebooks" / "tour.ipynb", GENERATED / "tour.ipynb")
for page in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
    text = page.read_text()
    if not text.startswith("#"):  # a bare table: the file's name is its title
        text = f"# Benchmark results: `benchmarks/results/{page.name}`\n\n{text}"
    (GENERATED / "benchmarks" / page.name).write_text(text)

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
# results/ holds what the scripts wrote; pages include its tables.
exclude_patterns = ["_build", "results/*.csv", "results/*.md"]
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
