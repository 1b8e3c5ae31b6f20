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
    sample_seq_len,
)
from bottleneck.data.corpora import (
    CORPORA,
    DATA_DIR_ENV,
    EOS,
    PTB,
    SPLITS,
    UNK,
    WIKITEXT2,
    CorpusSpec,
    Vocabulary,
    corpus_spec,
    decode_lines,
    find_corpus_dir,
    read_lines,
    read_split_tokens,
    tokenize_line,
    tokenize_lines,
)
from bottleneck.data.download import (
    DATA_URL_ENV,
    SHA256SUMS_ENV,
    ChecksumError,
    DownloadError,
    expected_sha256,
)
from bottleneck.data.tfds_builders import (
    Ptb,
    TokenizedCorpus,
    Wikitext2,
    limit_vocabulary,
    load_corpus,
    prepare_corpus,
    prepared_dir,
    read_prepared_ids,
    read_prepared_lines,
    read_prepared_tokens,
    release_sha256,
)

__all__ = [
    "CORPORA",
    "DATA_DIR_ENV",
    "DATA_URL_ENV",
    "EOS",
    "PTB",
    "SHA256SUMS_ENV",
    "SPLITS",
    "UNK",
    "WIKITEXT2",
    "BpttWindow",
    "ChecksumError",
    "CorpusSpec",
    "DownloadError",
    "Ptb",
    "TokenizedCorpus",
    "Vocabulary",
    "Wikitext2",
    "batchify",
    "bptt_windows",
    "corpus_spec",
    "decode_lines",
    "expected_sha256",
    "find_corpus_dir",
    "fixed_windows",
    "limit_vocabulary",
    "load_corpus",
    "prepare_corpus",
    "prepared_dir",
    "read_lines",
    "read_prepared_ids",
    "read_prepared_lines",
    "read_prepared_tokens",
    "read_split_tokens",
    "release_sha256",
    "sample_seq_len",
    "tokenize_line",
    "tokenize_lines",
]
