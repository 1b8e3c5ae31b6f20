"""Word-level language-modelling data: PTB and WikiText-2 through TFDS, vocabulary, BPTT batches.

Data flow: release files (``manual_dir`` / ``$BOTTLENECK_DATA_DIR``, else downloaded and checked
against their SHA-256: :mod:`bottleneck.data.download`) -> TFDS ``array_record``, kept in a folder
named by the files' digests (:func:`prepare_corpus`) -> tokens (whitespace split + ``<eos>`` per line) -> int32 ids
(:class:`Vocabulary`, :func:`load_corpus`) -> ``[num_steps, batch_size]`` columns (:func:`batchify`)
-> variable-length windows (:func:`bptt_windows`).
"""

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

__all__ = [
    "CORPORA",
    "DATA_DIR_ENV",
    "EOS",
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
