"""Where the tests find the checkout and the offline corpora."""

from pathlib import Path

#: The repository's root (the checkout under test).
ROOT = Path(__file__).resolve().parents[1]
#: The standard PTB and WikiText-2 files beside the checkout, where a machine has them
#: (``../shared/data``); tests that read them skip without.
SHARED_DATA_DIR = ROOT.parent / "shared" / "data"
