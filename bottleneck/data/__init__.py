"""Word-level language-modelling data: PTB and WikiText-2 through TFDS, vocabulary, BPTT batches.

Data flow: release files (``manual_dir`` / ``$BOTTLENECK_DATA_DIR``, else downloaded and checked
against their SHA-256: :mod:`bottleneck.data.download`) -> TFDS ``array_record``, kept in a folder
named by the files' digests (:func:`prepare_corpus`) -> tokens (whitespace split + ``<eos>`` per line) -> int32 ids
(:class:`Vocabulary`, :func:`load_corpus`) -> ``[num_steps, batch_size]`` columns (:func:`batchify`)
-> variable-length windows (:func:`bptt_windows`). :data:`FIXTURES_DIR` holds a corpus of a few
lines in each release's layout (PTB's and WikiText-2's file names; 18 training tokens), installed
with the package, for smoke runs and tests.
"""

from pathlib import Path

from bottleneck.data.batching import (
    BpttWindow,
    batchify,
    bptt_windows,
    fixed_windows,
)
from bottleneck.data.corpora import (
    CORPORA,
    DATA_DIR_ENV,
    EOS,
    UNK,
    Vocabulary,
)
from bottleneck.data.download import (
    ChecksumError,
    DownloadError,
)
from bottleneck.data.tfds_builders import (
    Ptb,
    TokenizedCorpus,
    Wikitext2,
    load_corpus,
    prepare_corpus,
)

#: A few lines of text in each corpus's release layout (``ptb/``, ``wikitext-2/``), for smoke runs.
FIXTURES_DIR = Path(__file__).parent / "fixtures"

__all__ = [
    "CORPORA",
    "DATA_DIR_ENV",
    "EOS",
    "FIXTURES_DIR",
    "UNK",
    "BpttWindow",
    "ChecksumError",
    "DownloadError",
    "Ptb",
    "TokenizedCorpus",
    "Vocabulary",
    "Wikitext2",
    "batchify",
    "bptt_windows",
    "fixed_windows",
    "load_corpus",
    "prepare_corpus",
]
