"""The API reference (docs/api/*.md) lists every exported name, and nothing that does not exist."""

import importlib
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[1] / "docs" / "api"
PACKAGES = ("bottleneck", "bottleneck.nn", "bottleneck.data", "bottleneck.train", "bottleneck.runs")


def documented() -> dict[str, set[str]]:
    """Module -> the names its autosummary blocks list, over every API page."""
    names: dict[str, set[str]] = {}
    for page in API.glob("*.md"):
        for module, body in re.findall(
            r"\.\. currentmodule:: ([\w.]+)\n\n\.\. autosummary::\n   :toctree: _autosummary\n\n"
            r"((?:   \w+\n)+)",
            page.read_text(),
        ):
            names.setdefault(module, set()).update(body.split())
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_in_the_reference(package):
    missing = sorted(
        set(importlib.import_module(package).__all__) - documented().get(package, set())
    )
    assert not missing, f"{package} exports {missing}, which docs/api/*.md does not list"


def test_every_listed_name_exists():
    for module, names in documented().items():
        imported = importlib.import_module(module)
        absent = sorted(name for name in names if not hasattr(imported, name))
        assert not absent, f"docs/api lists {module}.{absent}, which do not exist"
