"""TFDS builders for Penn Treebank and WikiText-2, prepared as ``array_record`` files.

Each example is one line of a release file, ``{"text": line}``, stored in file order (shuffling is
disabled), so a split read back through :meth:`~tfds.core.DatasetBuilder.as_data_source` is the
release file again. Reading needs no TensorFlow.

The release files come from a local directory (``manual_dir``, else ``$BOTTLENECK_DATA_DIR``) or,
when neither is given, are downloaded and checked against their SHA-256 (see
:mod:`bottleneck.data.download`). A prepared corpus records the SHA-256 of the files it was made
from (``builder.info.metadata["sha256"]``), and :func:`prepare_corpus` keeps it in a folder of
``data_dir`` named by those digests, so it is reused only for the same files.

Typical use::

    corpus = load_corpus("ptb", manual_dir="/path/to/data", data_dir="/tmp/tfds")
    corpus.train  # int32 token ids, shape [929589]
    corpus.sha256  # {"ptb.train.txt": "fcea91...", ...}
    corpus.token_counts  # {"train": 929589, "validation": 73760, "test": 82430}
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from bottleneck.data.corpora import (
    CORPORA,
    DATA_DIR_ENV,
    PTB,
    SPLITS,
    UNK,
    WIKITEXT2,
    CorpusSpec,
    Vocabulary,
    corpus_spec,
    decode_lines,
    find_corpus_dir,
    sha256_hex,
    tokenize_lines,
)
from bottleneck.data.download import (
    check_sha256,
    digests_key,
    download_release_files,
    expected_sha256,
)

logger = logging.getLogger(__name__)


def _manual_download_instructions(spec: CorpusSpec) -> str:
    return (
        f"Put {', '.join(spec.file_names)} ({spec.title}, {spec.homepage}) in one directory and "
        "pass it as `manual_dir` (or `tfds.download.DownloadConfig(manual_dir=...)`); without "
        "one, the release files are downloaded."
    )


class _LineCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A corpus whose examples are the lines of its three release files (train/valid/test).

    Prefer :func:`prepare_corpus`. Called directly, ``download_and_prepare`` reads the release
    files from ``DownloadConfig(manual_dir=...)`` (else ``$BOTTLENECK_DATA_DIR``; a missing file is
    a ``FileNotFoundError`` naming it), or downloads them when neither is given. The SHA-256 of
    the files read is recorded in ``info.metadata["sha256"]`` and their directory or URLs in
    ``info.metadata["source"]``.
    """

    CORPUS: ClassVar[CorpusSpec]
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Lines of the release files, in order."}

    # Set by `prepare_corpus` before `download_and_prepare`: release file name -> SHA-256 the
    # files read must have. `None` (direct use): local files are taken as they are, downloads are
    # checked against `download.expected_sha256`.
    _expected_sha256: dict[str, str] | None = None
    _given_manual_dir: os.PathLike | str | None = None

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"{self.CORPUS.title}: one example per line of the release files.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            homepage=self.CORPUS.homepage,
            citation=self.CORPUS.citation,
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    def _download_and_prepare(self, dl_manager, download_config, **kwargs: Any) -> None:
        # `_split_generators` sees only the download manager, whose manual dir defaults to
        # `<download_dir>/manual`; keep the one actually given, if any.
        self._given_manual_dir = download_config.manual_dir
        return super()._download_and_prepare(dl_manager, download_config, **kwargs)

    def _log_download_bytes(self) -> None:
        # TFDS prints "Downloading and preparing dataset Unknown size ...", even for local files.
        logger.info("Preparing %s in %s", self.CORPUS.title, self.data_dir)

    def _log_download_done(self) -> None:
        pass

    def _split_generators(
        self, dl_manager: tfds.download.DownloadManager
    ) -> dict[str, Iterator[tuple[int, dict[str, str]]]]:
        spec = self.CORPUS
        manual_dir = self._given_manual_dir
        if manual_dir is None:
            manual_dir = os.environ.get(DATA_DIR_ENV)
        if manual_dir is not None:
            corpus_dir = find_corpus_dir(spec, manual_dir)
            source = os.fspath(corpus_dir)
            contents = {name: (corpus_dir / name).read_bytes() for name in spec.file_names}
            where = {name: os.fspath(corpus_dir / name) for name in spec.file_names}
            expected = self._expected_sha256  # the digests `prepare_corpus` keyed the folder by
            for name in spec.file_names if expected is not None else ():
                check_sha256(
                    name, contents[name], expected[name], f"in {corpus_dir}", "hashed at the start"
                )
        else:
            expected = self._expected_sha256 or expected_sha256(spec)
            contents, where, source = download_release_files(spec, dl_manager, expected)
        lines = {name: decode_lines(contents[name], where[name]) for name in spec.file_names}
        self.info.metadata.update(
            source=source, sha256={name: sha256_hex(contents[name]) for name in spec.file_names}
        )
        return {
            split: self._generate_examples(lines[file_name])
            for split, file_name in spec.split_files.items()
        }

    def _generate_examples(self, lines: list[str]) -> Iterator[tuple[int, dict[str, str]]]:
        for line_number, line in enumerate(lines):
            yield line_number, {"text": line}


class Ptb(_LineCorpusBuilder):
    """Penn Treebank (Mikolov's preprocessing): 42,068 / 3,370 / 3,761 lines."""

    name = PTB.name
    CORPUS = PTB
    MANUAL_DOWNLOAD_INSTRUCTIONS = _manual_download_instructions(PTB)


class Wikitext2(_LineCorpusBuilder):
    """WikiText-2 v1 (tokenised), blank lines included: 36,718 / 3,760 / 4,358 lines."""

    name = WIKITEXT2.name
    CORPUS = WIKITEXT2
    MANUAL_DOWNLOAD_INSTRUCTIONS = _manual_download_instructions(WIKITEXT2)


_BUILDERS: dict[str, type[_LineCorpusBuilder]] = {cls.CORPUS.name: cls for cls in (Ptb, Wikitext2)}


def release_sha256(
    name: str, manual_dir: str | os.PathLike | None = None
) -> tuple[dict[str, str], Path | None]:
    """The SHA-256 of the release files corpus ``name`` would be prepared from, and their folder.

    With a local directory (``manual_dir``, else ``$BOTTLENECK_DATA_DIR``): the digests of its
    files (checked complete, see :func:`find_corpus_dir`) and that folder. Without one: the digests
    a download must have (:func:`~bottleneck.data.download.expected_sha256`) and ``None``.
    """
    spec = corpus_spec(name)
    if manual_dir is None:
        manual_dir = os.environ.get(DATA_DIR_ENV)
    if manual_dir is None:
        return expected_sha256(spec), None
    corpus_dir = find_corpus_dir(spec, manual_dir)
    sha256 = {file: sha256_hex((corpus_dir / file).read_bytes()) for file in spec.file_names}
    return sha256, corpus_dir


def prepared_dir(name: str, sha256: Mapping[str, str], data_dir: str | os.PathLike | None) -> Path:
    """The ``data_dir`` sub-folder for corpus ``name`` prepared from files with digests ``sha256``.

    ``<data_dir>/<name>-<16 hex digits of the digests' SHA-256>``; TFDS then writes
    ``<name>/<version>/`` inside it.
    """
    root = Path(tfds.core.constants.DATA_DIR if data_dir is None else data_dir).expanduser()
    return root / f"{name}-{digests_key(sha256)}"


def prepare_corpus(
    name: str,
    manual_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
) -> tfds.core.GeneratorBasedBuilder:
    """The builder of corpus ``name``, its ``array_record`` files prepared under ``data_dir``.

    The release files are those of ``manual_dir`` (else ``$BOTTLENECK_DATA_DIR``) or, when neither
    is given, downloaded (see :mod:`bottleneck.data.download`). The prepared corpus lives in a
    folder named by the SHA-256 of those files (:func:`prepared_dir`), so it is reused only for
    the same files: other files are prepared anew beside it, and a download needs no network once
    prepared. TFDS writes into a temporary folder renamed at the end, so a failed preparation
    leaves nothing that is reused.

    Args:
        name: ``"ptb"`` or ``"wikitext2"``.
        manual_dir: directory with the release files (or a root with a ``ptb/`` or
            ``wikitext-2/`` folder); ``None`` reads ``$BOTTLENECK_DATA_DIR``, then downloads.
        data_dir: root of the prepared corpora; ``None`` is TFDS's default (``$TFDS_DATA_DIR`` or
            ``~/tensorflow_datasets``).

    Raises:
        FileNotFoundError: a local release file is missing (before anything is written).
        ValueError: unknown ``name``; a release file is empty, truncated or not UTF-8; the folder
            for these files holds a corpus prepared from other files.
        download.DownloadError: (a ``FileNotFoundError``) the download failed.
        download.ChecksumError: (a ``ValueError``) a release file has an unexpected SHA-256.
    """
    spec = corpus_spec(name)
    sha256, corpus_dir = release_sha256(spec.name, manual_dir)
    builder = _BUILDERS[spec.name](
        data_dir=os.fspath(prepared_dir(spec.name, sha256, data_dir)),
        file_format=tfds.core.FileFormat.ARRAY_RECORD,
    )
    if builder.data_path.exists():  # The test `download_and_prepare` uses to reuse data.
        recorded = dict(builder.info.metadata.get("sha256") or {})
        if recorded != sha256:
            raise ValueError(
                f"{builder.data_path} holds {spec.title} prepared from files with SHA-256 "
                f"{recorded or 'unrecorded'}, not {sha256}; delete that folder to prepare it again."
            )
        return builder
    builder._expected_sha256 = sha256
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(
            manual_dir=None if corpus_dir is None else os.fspath(corpus_dir)
        )
    )
    return builder


def read_prepared_lines(builder: tfds.core.DatasetBuilder, split: str) -> list[str]:
    """The lines of a prepared split (one of ``SPLITS``), in file order, via ``as_data_source``."""
    source = builder.as_data_source(split=split)
    # One batched read: several times faster than iterating record by record.
    records = source.__getitems__(range(len(source)))
    return [record["text"].decode("utf-8") for record in records]


def read_prepared_tokens(builder: tfds.core.DatasetBuilder, split: str) -> list[str]:
    """The tokens of a prepared split, ``<eos>`` closing every line (blank lines included)."""
    return tokenize_lines(read_prepared_lines(builder, split))


def read_prepared_ids(
    builder: tfds.core.DatasetBuilder, split: str, vocabulary: Vocabulary
) -> np.ndarray:
    """A prepared split as one flat array of int32 token ids, shape ``[num_tokens]``.

    Raises:
        ValueError: a token of the split is not in ``vocabulary``.
    """
    return vocabulary.encode(read_prepared_tokens(builder, split))


class TokenizedCorpus(NamedTuple):
    """A corpus as token ids: the training-split vocabulary and each split as one flat array.

    Attributes:
        vocabulary: built from the training split, ``<eos>`` included.
        train: int32 token ids, shape ``[num_train_tokens]``.
        validation: int32 token ids, shape ``[num_validation_tokens]``.
        test: int32 token ids, shape ``[num_test_tokens]``.
        name: the corpus (``"ptb"``, ``"wikitext2"``).
        sha256: release file name -> SHA-256 (hex) of the file the prepared corpus was made from.
        token_counts: split -> number of tokens of the prepared split (``<eos>`` included), as
            loaded; slicing the arrays later (``_replace``) leaves it as it is.
        source: where the release files were read when the corpus was prepared (a directory, or
            the URLs downloaded).
    """

    vocabulary: Vocabulary
    train: np.ndarray
    validation: np.ndarray
    test: np.ndarray
    name: str = ""
    sha256: Mapping[str, str] = {}  # plain dicts (picklable), read-only by convention
    token_counts: Mapping[str, int] = {}
    source: str = ""

    @property
    def matches_release(self) -> bool:
        """Whether :attr:`sha256` are the published release's digests (the standard corpus)."""
        spec = CORPORA.get(self.name)
        return spec is not None and bool(self.sha256) and dict(self.sha256) == dict(spec.sha256)

    def provenance(self) -> dict[str, Any]:
        """What identifies the data, JSON-ready: corpus, files' SHA-256, token counts, source."""
        return {
            "corpus": self.name,
            "sha256": dict(self.sha256),
            "matches_release": self.matches_release,
            "token_counts": dict(self.token_counts),
            "vocabulary_size": len(self.vocabulary),
            "source": self.source,
        }


def limit_vocabulary(corpus: TokenizedCorpus, size: int) -> TokenizedCorpus:
    """The corpus over its ``size`` most frequent training words; every other word is ``<unk>``.

    Frequencies are counted on the training split; ties keep the earlier word. ``<eos>`` and
    ``<unk>`` are always in the vocabulary (``<unk>`` is added if the corpus has none). Kept words
    keep their relative order, so the ids stay in first-occurrence order. A ``size`` at least the
    vocabulary's returns the corpus unchanged.

    Example (PTB's 10,000 words to 2,000: 13% of the training tokens become ``<unk>``)::

        small = limit_vocabulary(load_corpus("ptb", manual_dir=...), 2000)
    """
    vocabulary = corpus.vocabulary
    if size < 2:
        raise ValueError(f"size must be >= 2 (<eos> and <unk>), got {size}")
    if size >= len(vocabulary):
        return corpus
    has_unk = UNK in vocabulary
    forced = [int(vocabulary.eos_id)] + ([int(vocabulary.encode([UNK])[0])] if has_unk else [])
    counts = np.bincount(corpus.train, minlength=len(vocabulary))
    by_frequency = [i for i in np.argsort(-counts, kind="stable").tolist() if i not in forced]
    kept = sorted(forced + by_frequency[: size - len(forced) - (0 if has_unk else 1)])
    tokens = [vocabulary.tokens[i] for i in kept] + ([] if has_unk else [UNK])
    new_ids = np.full(len(vocabulary), tokens.index(UNK), np.int32)
    new_ids[kept] = np.arange(len(kept), dtype=np.int32)
    return corpus._replace(
        vocabulary=Vocabulary(tokens),
        train=new_ids[corpus.train],
        validation=new_ids[corpus.validation],
        test=new_ids[corpus.test],
    )


def load_corpus(
    name: str,
    manual_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
) -> TokenizedCorpus:
    """Prepares corpus ``name`` if needed (see :func:`prepare_corpus`) and returns it as ids.

    The result also carries the SHA-256 of the release files and the token count of each split
    (:meth:`TokenizedCorpus.provenance`).

    Raises:
        ValueError: a validation or test token is missing from the training vocabulary; see
            :func:`prepare_corpus` for the rest.
    """
    builder = prepare_corpus(name, manual_dir, data_dir)
    train_tokens = read_prepared_tokens(builder, "train")
    vocabulary = Vocabulary.from_tokens(train_tokens)
    splits = {
        "train": vocabulary.encode(train_tokens),
        "validation": read_prepared_ids(builder, "validation", vocabulary),
        "test": read_prepared_ids(builder, "test", vocabulary),
    }
    metadata = builder.info.metadata
    return TokenizedCorpus(
        vocabulary=vocabulary,
        **splits,
        name=builder.CORPUS.name,
        sha256=dict(metadata["sha256"]),
        token_counts={split: int(splits[split].size) for split in SPLITS},
        source=str(metadata["source"]),
    )
