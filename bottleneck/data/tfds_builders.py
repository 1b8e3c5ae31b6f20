"""TFDS builders for Penn Treebank and WikiText-2, prepared offline as ``array_record`` files.

Each example is one line of a release file, ``{"text": line}``, stored in file order (shuffling is
disabled), so a split read back through :meth:`~tfds.core.DatasetBuilder.as_data_source` is the
release file again. Reading needs no TensorFlow.

Typical use::

    builder = prepare_corpus("ptb", manual_dir="/path/to/data", data_dir="/tmp/tfds")
    corpus = load_corpus("ptb", manual_dir="/path/to/data", data_dir="/tmp/tfds")
    corpus.train  # int32 token ids, shape [929589]
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from bottleneck.data.corpora import (
    PTB,
    WIKITEXT2,
    CorpusSpec,
    Vocabulary,
    corpus_spec,
    find_corpus_dir,
    read_lines,
    tokenize_lines,
)


def _manual_download_instructions(spec: CorpusSpec) -> str:
    return (
        f"Put {', '.join(spec.file_names)} ({spec.title}, {spec.homepage}) in one directory and "
        "pass it as `manual_dir` (or `tfds.download.DownloadConfig(manual_dir=...)`)."
    )


class _LineCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A corpus whose examples are the lines of its three release files (train/valid/test).

    Prefer :func:`prepare_corpus`. Called directly, ``download_and_prepare`` reads the release
    files from ``DownloadConfig(manual_dir=...)``; if that directory is missing or empty, TFDS
    raises its own ``AssertionError`` (naming the directory and the expected files).
    """

    CORPUS: ClassVar[CorpusSpec]
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Lines of the release files, in order."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"{self.CORPUS.title}: one example per line of the release files.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            homepage=self.CORPUS.homepage,
            citation=self.CORPUS.citation,
            disable_shuffling=True,
        )

    def _split_generators(
        self, dl_manager: tfds.download.DownloadManager
    ) -> dict[str, Iterator[tuple[int, dict[str, str]]]]:
        corpus_dir = find_corpus_dir(self.CORPUS, dl_manager.manual_dir)
        return {
            split: self._generate_examples(os.fspath(corpus_dir / file_name))
            for split, file_name in self.CORPUS.split_files.items()
        }

    def _generate_examples(self, path: str) -> Iterator[tuple[int, dict[str, str]]]:
        for line_number, line in enumerate(read_lines(path)):
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


def prepare_corpus(
    name: str,
    manual_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
) -> tfds.core.GeneratorBasedBuilder:
    """The builder of corpus ``name``, its ``array_record`` files prepared in ``data_dir``.

    Preparation runs once; later calls reuse the prepared files and need no release files.

    Args:
        name: ``"ptb"`` or ``"wikitext2"``.
        manual_dir: directory with the release files (or a root with a ``ptb/`` or
            ``wikitext-2/`` folder); ``None`` reads ``$BOTTLENECK_DATA_DIR``.
        data_dir: where the prepared dataset goes (``<data_dir>/<name>/<version>/``); ``None`` is
            TFDS's default (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Raises:
        FileNotFoundError: a release file is missing (before anything is written).
        ValueError: unknown ``name``, or a release file is empty or truncated.
    """
    spec = corpus_spec(name)
    builder = _BUILDERS[spec.name](
        data_dir=None if data_dir is None else os.fspath(data_dir),
        file_format=tfds.core.FileFormat.ARRAY_RECORD,
    )
    if not builder.data_path.exists():  # The test `download_and_prepare` uses to reuse data.
        corpus_dir = find_corpus_dir(spec, manual_dir)
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(corpus_dir))
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
    """

    vocabulary: Vocabulary
    train: np.ndarray
    validation: np.ndarray
    test: np.ndarray


def load_corpus(
    name: str,
    manual_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
) -> TokenizedCorpus:
    """Prepares corpus ``name`` if needed (see :func:`prepare_corpus`) and returns it as ids.

    Raises:
        ValueError: a validation or test token is missing from the training vocabulary.
    """
    builder = prepare_corpus(name, manual_dir, data_dir)
    train_tokens = read_prepared_tokens(builder, "train")
    vocabulary = Vocabulary.from_tokens(train_tokens)
    return TokenizedCorpus(
        vocabulary=vocabulary,
        train=vocabulary.encode(train_tokens),
        validation=read_prepared_ids(builder, "validation", vocabulary),
        test=read_prepared_ids(builder, "test", vocabulary),
    )
