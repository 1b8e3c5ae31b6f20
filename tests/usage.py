"""A usage error's text as a test reads it: tyro's box (a parse error, a value a config refuses)
without its frame, or a script's own one line (``NAME.py: error: ...``), whitespace joined."""

from __future__ import annotations

import re

_FRAME = re.compile(r"[\u2500-\u257f]|-{3,}|^\s*[|+]|[|+]\s*$", re.MULTILINE)


def plain(stderr: str) -> str:
    """``stderr`` without tyro's frame (box-drawing or ASCII), its lines joined by one space."""
    return " ".join(_FRAME.sub(" ", stderr).split())
