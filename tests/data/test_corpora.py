"""Corpora: release-file checks, TFDS builders (array_record, read back without TensorFlow),
tokenization, vocabulary; on the fixtures always, on the real corpora when ``../shared/data`` exists."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from bottleneck.data import (
    DATA_DIR_ENV,
    EOS,
    PTB,
    SPLITS,
    WIKITEXT2,
    CorpusSpec,
    Ptb,
    TokenizedCorpus,
    Vocabulary,
    corpus_spec,
    load_corpus,
    prepare_corpus,
    read_prepared_ids,
    read_prepared_lines,
    read_prepared_tokens,
    read_split_tokens,
    tokenize_line,
)

FIXTURES_DIR = Path(__file__).parent / "fixtures"
SHARED_DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"

FIXTURE_TOKENS = {
    "ptb": {
        "train": "the cat sat on the mat <eos> the dog sat <eos> a cat <unk> N years ago <eos>",
        "validation": "the cat sat <eos>",
        "test": "a dog sat on the mat <eos> N years ago <eos>",
    },
    "wikitext2": {
        "train": "<eos> = Valkyria Chronicles = <eos> <eos> Senjō no Valkyria is a game . <eos> "
        "<eos> It is @-@ a <unk> . <eos>",
        "validation": "<eos> = Senjō = <eos> <eos>",
        "test": "<eos> It is a game . <eos>",
    },
}
FIXTURE_VOCABULARY = {
    "ptb": "the cat sat on mat <eos> dog a <unk> N years ago",
    "wikitext2": "<eos> = Valkyria Chronicles Senjō no is a game . It @-@ <unk>",
}
REAL_TOKEN_COUNTS = {
    "ptb": {"train": 929_589, "validation": 73_760, "test": 82_430},
    "wikitext2": {"train": 2_088_628, "validation": 217_646, "test": 245_569},
}
REAL_VOCABULARY_SIZES = {"ptb": 10_000, "wikitext2": 33_278}


def copy_fixture(spec: CorpusSpec, destination: Path) -> Path:
    """A writable copy of ``spec``'s fixture files, in ``destination / spec.folder``."""
    return Path(shutil.copytree(FIXTURES_DIR / spec.folder, destination / spec.folder))


@pytest.fixture(autouse=True)
def no_data_dir_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see ``$BOTTLENECK_DATA_DIR`` only where they set it."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


# --- tokenization and vocabulary -------------------------------------------------------------


def test_tokenize_line_appends_eos_and_blank_line_is_one_eos() -> None:
    assert tokenize_line(" the cat  sat \n") == ["the", "cat", "sat", EOS]
    assert tokenize_line(" ") == [EOS]
    assert tokenize_line("") == [EOS]


def test_vocabulary_first_occurrence_order_and_round_trip() -> None:
    vocabulary = Vocabulary.from_tokens("b a <eos> b c <eos>".split())
    assert vocabulary.tokens == ("b", "a", EOS, "c")
    assert len(vocabulary) == 4 and vocabulary.eos_id == 2 and "c" in vocabulary
    ids = vocabulary.encode(["c", "b", EOS])
    assert ids.dtype == np.int32 and ids.tolist() == [3, 0, 2]
    assert vocabulary.decode(ids) == ["c", "b", EOS]
    assert vocabulary.encode([]).shape == (0,) and vocabulary.decode([]) == []


def test_vocabulary_rejects_unknown_tokens_bad_ids_and_duplicates() -> None:
    vocabulary = Vocabulary(["a", EOS])
    with pytest.raises(ValueError, match="'zebra'"):
        vocabulary.encode(["a", "zebra"])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        vocabulary.decode([0, 2])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        vocabulary.decode([-1])
    with pytest.raises(ValueError, match="distinct"):
        Vocabulary(["a", "a"])


def test_corpus_spec_names_the_known_corpora() -> None:
    assert corpus_spec("ptb") is PTB and corpus_spec("wikitext2") is WIKITEXT2
    with pytest.raises(ValueError, match="ptb, wikitext2"):
        corpus_spec("enwik8")


# --- builders on the fixtures ----------------------------------------------------------------


@pytest.mark.parametrize("spec", [PTB, WIKITEXT2], ids=lambda spec: spec.name)
def test_builder_prepares_array_record_and_reads_lines_back(spec: CorpusSpec, tmp_path: Path):
    builder = prepare_corpus(spec.name, FIXTURES_DIR / spec.folder, tmp_path)
    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    assert sorted(builder.data_path.glob("*.array_record-*")), "no array_record files written"
    for split in SPLITS:
        release_text = (FIXTURES_DIR / spec.folder / spec.split_files[split]).read_text("utf-8")
        assert read_prepared_lines(builder, split) == release_text.split("\n")[:-1]
        expected_tokens = FIXTURE_TOKENS[spec.name][split].split()
        assert read_prepared_tokens(builder, split) == expected_tokens
        assert read_split_tokens(spec, split, FIXTURES_DIR) == expected_tokens


@pytest.mark.parametrize("spec", [PTB, WIKITEXT2], ids=lambda spec: spec.name)
def test_load_corpus_gives_training_vocabulary_and_flat_int32_ids(spec: CorpusSpec, tmp_path):
    corpus = load_corpus(spec.name, FIXTURES_DIR, tmp_path)
    assert corpus.vocabulary.tokens == tuple(FIXTURE_VOCABULARY[spec.name].split())
    for split, ids in zip(SPLITS, (corpus.train, corpus.validation, corpus.test), strict=True):
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert corpus.vocabulary.decode(ids) == FIXTURE_TOKENS[spec.name][split].split()


def test_wikitext_blank_lines_count_one_eos_each(tmp_path: Path) -> None:
    builder = prepare_corpus("wikitext2", FIXTURES_DIR, tmp_path)
    lines = read_prepared_lines(builder, "train")
    blank_lines = sum(1 for line in lines if not line.strip())
    assert blank_lines == 3
    assert read_prepared_tokens(builder, "train").count(EOS) == len(lines) == 6


def test_prepared_data_is_reused_without_release_files(tmp_path: Path) -> None:
    first = load_corpus("ptb", FIXTURES_DIR, tmp_path / "prepared")
    second = load_corpus("ptb", tmp_path / "no-such-dir", tmp_path / "prepared")
    assert second.vocabulary.tokens == first.vocabulary.tokens
    np.testing.assert_array_equal(second.test, first.test)


def test_data_dir_environment_variable_is_the_fallback(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(FIXTURES_DIR))
    builder = prepare_corpus("wikitext2", data_dir=tmp_path)
    assert read_prepared_tokens(builder, "test") == FIXTURE_TOKENS["wikitext2"]["test"].split()


def test_builder_works_directly_with_tfds_download_config(tmp_path: Path) -> None:
    builder = Ptb(data_dir=str(tmp_path), file_format=tfds.core.FileFormat.ARRAY_RECORD)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(FIXTURES_DIR))
    )
    ids = read_prepared_ids(
        builder, "validation", Vocabulary.from_tokens("the cat sat <eos>".split())
    )
    assert ids.tolist() == [0, 1, 2, 3]


# --- release-file errors -------------------------------------------------------------------


def assert_names_expected_files(message: str, spec: CorpusSpec) -> None:
    for file_name in spec.file_names:
        assert file_name in message


@pytest.mark.parametrize("spec", [PTB, WIKITEXT2], ids=lambda spec: spec.name)
def test_missing_file_fails_at_once_naming_files_and_directory(spec: CorpusSpec, tmp_path):
    corpus_dir = copy_fixture(spec, tmp_path / "raw")
    (corpus_dir / spec.split_files["validation"]).unlink()
    with pytest.raises(FileNotFoundError) as error:
        prepare_corpus(spec.name, corpus_dir, tmp_path / "prepared")
    message = str(error.value)
    assert message.startswith(f"Missing {spec.split_files['validation']} in {corpus_dir} ")
    assert_names_expected_files(message, spec)
    assert not (tmp_path / "prepared" / spec.name).exists()


def test_missing_file_in_corpus_folder_of_a_data_root_is_named(tmp_path: Path) -> None:
    corpus_dir = copy_fixture(WIKITEXT2, tmp_path)
    (corpus_dir / "wiki.test.tokens").unlink()
    with pytest.raises(FileNotFoundError, match=f"Missing wiki.test.tokens in {corpus_dir} "):
        prepare_corpus("wikitext2", tmp_path, tmp_path / "prepared")


def test_missing_directory_fails_naming_files_and_directories(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as error:
        prepare_corpus("ptb", tmp_path / "nowhere", tmp_path / "prepared")
    message = str(error.value)
    assert str(tmp_path / "nowhere") in message and str(tmp_path / "nowhere" / "ptb") in message
    assert_names_expected_files(message, PTB)


def test_no_directory_and_no_environment_variable_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=DATA_DIR_ENV) as error:
        prepare_corpus("wikitext2", data_dir=tmp_path)
    assert_names_expected_files(str(error.value), WIKITEXT2)


@pytest.mark.parametrize(
    ("content", "problem"),
    [(b"", "is empty"), (b" a dog sat on the mat \n N years", "truncated")],
    ids=["empty", "no-final-newline"],
)
def test_empty_or_truncated_file_fails_at_once(tmp_path: Path, content: bytes, problem: str):
    corpus_dir = copy_fixture(PTB, tmp_path / "raw")
    (corpus_dir / "ptb.test.txt").write_bytes(content)
    with pytest.raises(ValueError, match=problem) as error:
        prepare_corpus("ptb", corpus_dir, tmp_path / "prepared")
    message = str(error.value)
    assert message.startswith(f"ptb.test.txt in {corpus_dir} ")
    assert_names_expected_files(message, PTB)
    assert not (tmp_path / "prepared" / "ptb").exists()


def test_builder_used_directly_reports_missing_files(tmp_path: Path) -> None:
    corpus_dir = copy_fixture(PTB, tmp_path / "raw")
    (corpus_dir / "ptb.train.txt").unlink()
    builder = Ptb(
        data_dir=str(tmp_path / "prepared"), file_format=tfds.core.FileFormat.ARRAY_RECORD
    )
    with pytest.raises(FileNotFoundError, match="Missing ptb.train.txt"):
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=str(corpus_dir))
        )


# --- the real corpora (../shared/data) -------------------------------------------------------


@pytest.fixture(scope="module", params=["ptb", "wikitext2"])
def real_corpus(request, tmp_path_factory) -> tuple[str, TokenizedCorpus]:
    """A real corpus prepared through its TFDS builder into a temporary data dir."""
    if not SHARED_DATA_DIR.is_dir():
        pytest.skip(f"real corpora not found at {SHARED_DATA_DIR}")
    name = request.param
    return name, load_corpus(name, SHARED_DATA_DIR, tmp_path_factory.mktemp(name))


def test_real_corpus_token_counts_and_vocabulary(real_corpus) -> None:
    name, corpus = real_corpus
    counts = {
        "train": corpus.train.size,
        "validation": corpus.validation.size,
        "test": corpus.test.size,
    }
    assert counts == REAL_TOKEN_COUNTS[name]
    assert len(corpus.vocabulary) == REAL_VOCABULARY_SIZES[name]
    assert EOS in corpus.vocabulary
    assert int(corpus.vocabulary.encode([EOS])[0]) == corpus.vocabulary.eos_id


def test_real_corpus_builder_matches_plain_reading(real_corpus) -> None:
    name, corpus = real_corpus
    plain_test_tokens = read_split_tokens(corpus_spec(name), "test", SHARED_DATA_DIR)
    assert corpus.vocabulary.decode(corpus.test) == plain_test_tokens
