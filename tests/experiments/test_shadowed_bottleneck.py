"""Another package named bottleneck (NumPy's Bottleneck) first on the path: one line, not a traceback."""

import ast
import subprocess
import sys

import pytest

from tests.paths import ROOT

SCRIPTS = sorted(p for p in (ROOT / "experiments").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_imports_the_check_before_anything_else(script):
    body = ast.parse(script.read_text()).body
    imports = [node for node in body if isinstance(node, (ast.Import, ast.ImportFrom))]
    imports = [node for node in imports if getattr(node, "module", None) != "__future__"]
    assert (
        isinstance(imports[0], ast.Import) and imports[0].names[0].name == "softmax_bottleneck"
    ), f"{script.name} must import softmax_bottleneck first"


def test_a_shadowing_bottleneck_stops_a_script_with_one_line(tmp_path):
    # What `pip install pandas bottleneck` puts first on the path, reduced to its version.
    (tmp_path / "bottleneck").mkdir()
    (tmp_path / "bottleneck" / "__init__.py").write_text('__version__ = "1.6.0"\n')
    process = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "synthetic.py"), "--help"],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert process.returncode == 1
    assert process.stdout == ""
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert "version 1.6.0" in lines[0] and "virtual environment of its own" in lines[0]
