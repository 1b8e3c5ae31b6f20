"""README's Python blocks must run as written (the quickstart is the first thing users paste)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python block"
    namespace = {}  # one namespace, top to bottom, as a reader pastes them into a notebook
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
