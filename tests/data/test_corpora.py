"""Corpora: release-file checks, TFDS builders (array_record, read back without TensorFlow),
prepared corpora keyed by the files' SHA-256, tokenization, vocabulary; on the fixtures always, on
the real corpora when ``../shared/data`` exists. Downloads: ``test_download.py``."""

from __future__ import annotations

import hashlib
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from bottleneck.data import (
    DATA_DIR_ENV,
    EOS,
    FIXTURES_DIR,
    ChecksumError,
    Ptb,
    TokenizedCorpus,
    Vocabulary,
    load_corpus,
    prepare_corpus,
)
from bottleneck.data.corpora import (
    PTB,
    SPLITS,
    WIKITEXT2,
    CorpusSpec,
    corpus_spec,
    find_corpus_dir,
    read_split_tokens,
    tokenize_line,
)
from bottleneck.data.download import DATA_URL_ENV, SHA256SUMS_ENV
from bottleneck.data.tfds_builders import (
    read_prepared_ids,
    read_prepared_lines,
    read_prepared_tokens,
    release_sha256,
)
from bottleneck.runs.cli import show_logs
from tests.paths import SHARED_DATA_DIR

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


def fixture_sha256(spec: CorpusSpec) -> dict[str, str]:
    return {
        name: hashlib.sha256((FIXTURES_DIR / spec.folder / name).read_bytes()).hexdigest()
        for name in spec.file_names
    }


def closed_loopback_url() -> str:
    """An ``http://127.0.0.1:<port>`` URL on which nothing listens (connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def no_data_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see ``$BOTTLENECK_DATA_DIR`` only where they set it, and never reach a real host."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.delenv(SHA256SUMS_ENV, raising=False)
    monkeypatch.setenv(DATA_URL_ENV, closed_loopback_url())


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


@pytest.mark.parametrize("spec", [PTB, WIKITEXT2], ids=lambda spec: spec.name)
def test_load_corpus_reports_files_sha256_and_token_counts(spec: CorpusSpec, tmp_path: Path):
    corpus = load_corpus(spec.name, FIXTURES_DIR, tmp_path)
    assert dict(corpus.sha256) == fixture_sha256(spec)
    assert dict(corpus.token_counts) == {
        split: len(FIXTURE_TOKENS[spec.name][split].split()) for split in SPLITS
    }
    assert corpus.name == spec.name and corpus.source == str(FIXTURES_DIR / spec.folder)
    assert not corpus.matches_release  # fixtures, not the published files
    provenance = corpus.provenance()
    assert provenance["sha256"] == fixture_sha256(spec)
    assert provenance["token_counts"] == dict(corpus.token_counts)
    assert provenance["vocabulary_size"] == len(FIXTURE_VOCABULARY[spec.name].split())
    sliced = corpus._replace(train=corpus.train[:2])  # as experiments truncate splits
    assert sliced.token_counts == corpus.token_counts and sliced.sha256 == corpus.sha256


def test_prepared_corpus_is_reused_for_the_same_files(tmp_path: Path) -> None:
    first = load_corpus("ptb", FIXTURES_DIR, tmp_path / "prepared")
    copy = copy_fixture(PTB, tmp_path / "copy")  # same bytes elsewhere: same prepared corpus
    second = load_corpus("ptb", copy, tmp_path / "prepared")
    assert second.source == first.source == str(FIXTURES_DIR / "ptb")  # prepared once
    assert second.vocabulary.tokens == first.vocabulary.tokens
    np.testing.assert_array_equal(second.test, first.test)
    assert len(list((tmp_path / "prepared").iterdir())) == 1


def test_a_given_directory_without_the_files_is_an_error_even_when_prepared(tmp_path):
    load_corpus("ptb", FIXTURES_DIR, tmp_path / "prepared")
    with pytest.raises(FileNotFoundError, match="Missing ptb.train.txt"):
        load_corpus("ptb", tmp_path / "no-such-dir", tmp_path / "prepared")


@pytest.mark.parametrize("spec", [PTB, WIKITEXT2], ids=lambda spec: spec.name)
def test_other_files_in_the_same_data_dir_are_prepared_again(spec: CorpusSpec, tmp_path):
    """Issue 10: the prepared corpus of directory A was returned for directory B."""
    dir_a = copy_fixture(spec, tmp_path / "a")
    dir_b = copy_fixture(spec, tmp_path / "b")
    test_file = spec.split_files["test"]
    (dir_b / test_file).write_text((dir_a / test_file).read_text("utf-8") * 2, "utf-8")
    expected_test = FIXTURE_TOKENS[spec.name]["test"].split()
    corpus_a = load_corpus(spec.name, dir_a, tmp_path / "tfds")
    corpus_b = load_corpus(spec.name, dir_b, tmp_path / "tfds")
    assert corpus_b.vocabulary.decode(corpus_b.test) == expected_test * 2
    assert corpus_b.sha256[test_file] != corpus_a.sha256[test_file]
    assert corpus_b.token_counts["test"] == 2 * corpus_a.token_counts["test"]
    again_a = load_corpus(spec.name, dir_a, tmp_path / "tfds")  # both stay prepared
    assert again_a.vocabulary.decode(again_a.test) == expected_test
    assert again_a.source == str(dir_a)


def test_fixed_file_is_read_after_a_failed_and_after_a_wrong_preparation(tmp_path: Path) -> None:
    """Issue 10: once prepared (or tried) from a bad file, the fixed file was never read again."""
    corpus_dir = copy_fixture(PTB, tmp_path / "raw")
    good = (corpus_dir / "ptb.test.txt").read_bytes()
    (corpus_dir / "ptb.test.txt").write_bytes(b" a dog \xe9 sat \n")  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match="ptb.test.txt is not UTF-8"):
        load_corpus("ptb", corpus_dir, tmp_path / "tfds")
    (corpus_dir / "ptb.test.txt").write_bytes(good.split(b"\n")[0] + b"\n")  # cut at a line
    cut = load_corpus("ptb", corpus_dir, tmp_path / "tfds")
    assert cut.token_counts["test"] == 7
    (corpus_dir / "ptb.test.txt").write_bytes(good)
    fixed = load_corpus("ptb", corpus_dir, tmp_path / "tfds")
    assert fixed.vocabulary.decode(fixed.test) == FIXTURE_TOKENS["ptb"]["test"].split()


def test_half_written_preparation_is_never_reused(tmp_path: Path, monkeypatch) -> None:
    def failing_examples(self, lines):
        yield 0, {"text": lines[0]}
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(Ptb, "_generate_examples", failing_examples)
        with pytest.raises(OSError, match="disk full"):
            load_corpus("ptb", FIXTURES_DIR, tmp_path / "tfds")
    corpus = load_corpus("ptb", FIXTURES_DIR, tmp_path / "tfds")
    assert corpus.vocabulary.decode(corpus.train) == FIXTURE_TOKENS["ptb"]["train"].split()


def test_file_changed_during_preparation_is_refused(tmp_path: Path, monkeypatch) -> None:
    import bottleneck.data.tfds_builders as tfds_builders

    def stale_sha256(name, manual_dir=None):  # as if the file changed after being hashed
        sha256, corpus_dir = release_sha256(name, manual_dir)
        return {**sha256, "ptb.valid.txt": "0" * 64}, corpus_dir

    monkeypatch.setattr(tfds_builders, "release_sha256", stale_sha256)
    with pytest.raises(ChecksumError, match=f"ptb.valid.txt \\(in {FIXTURES_DIR / 'ptb'}\\)"):
        load_corpus("ptb", FIXTURES_DIR, tmp_path / "tfds")
    assert not any((tmp_path / "tfds").rglob("*.array_record*"))


def test_preparing_other_files_into_a_folder_keyed_for_others_is_refused(tmp_path: Path):
    """The folder name is a digest of the files' digests; its recorded digests must agree."""
    load_corpus("ptb", FIXTURES_DIR, tmp_path / "tfds")
    (prepared,) = (tmp_path / "tfds").iterdir()
    other = copy_fixture(PTB, tmp_path / "other")
    (other / "ptb.valid.txt").write_text(" a cat \n", "utf-8")
    load_corpus("ptb", other, tmp_path / "tfds")
    other_prepared = next(path for path in (tmp_path / "tfds").iterdir() if path != prepared)
    shutil.rmtree(other_prepared)
    shutil.copytree(prepared, other_prepared)  # a mislabelled folder
    with pytest.raises(ValueError, match="prepared from files with SHA-256"):
        load_corpus("ptb", other, tmp_path / "tfds")


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
    reloaded = Ptb(data_dir=str(tmp_path), file_format=tfds.core.FileFormat.ARRAY_RECORD)
    assert dict(reloaded.info.metadata["sha256"]) == fixture_sha256(PTB)
    assert reloaded.info.metadata["source"] == str(FIXTURES_DIR / "ptb")


def test_preparing_prints_no_misleading_download_size(tmp_path: Path, capsys) -> None:
    show_logs()  # as the scripts do
    prepare_corpus("ptb", FIXTURES_DIR, tmp_path)
    captured = capsys.readouterr()
    assert "Unknown size" not in captured.out + captured.err
    assert "Downloading" not in captured.out + captured.err
    assert "Preparing Penn Treebank" in captured.err


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


def test_plain_reading_without_directory_or_environment_variable_fails() -> None:
    # `prepare_corpus` downloads instead (test_download.py); plain reading needs local files.
    with pytest.raises(FileNotFoundError, match=DATA_DIR_ENV) as error:
        find_corpus_dir(WIKITEXT2)
    assert_names_expected_files(str(error.value), WIKITEXT2)


@pytest.mark.parametrize("spec", [PTB, WIKITEXT2], ids=lambda spec: spec.name)
def test_non_utf8_file_fails_naming_it(spec: CorpusSpec, tmp_path: Path) -> None:
    corpus_dir = copy_fixture(spec, tmp_path / "raw")
    valid_file = corpus_dir / spec.split_files["validation"]
    valid_file.write_bytes(b" the cat \n sat \xff\xfe on \n")
    pattern = f"{valid_file} is not UTF-8 text .*line 2, byte offset 15"
    with pytest.raises(ValueError, match=pattern):
        prepare_corpus(spec.name, corpus_dir, tmp_path / "prepared")
    with pytest.raises(ValueError, match=pattern):
        read_split_tokens(spec, "validation", corpus_dir)
    assert not any((tmp_path / "prepared").rglob("*.array_record*"))


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


def test_real_corpus_files_are_the_published_release(real_corpus) -> None:
    name, corpus = real_corpus
    assert dict(corpus.sha256) == dict(corpus_spec(name).sha256)
    assert corpus.matches_release
    assert dict(corpus.token_counts) == REAL_TOKEN_COUNTS[name]


def test_published_digests_are_those_of_the_shared_sha256sums() -> None:
    sums_file = SHARED_DATA_DIR / "SHA256SUMS"
    if not sums_file.is_file():
        pytest.skip(f"{sums_file} not found")
    listed = {}
    for line in sums_file.read_text().splitlines():
        digest, path = line.split()
        listed[Path(path).name] = digest
    for spec in (PTB, WIKITEXT2):
        assert dict(spec.sha256) == {name: listed[name] for name in spec.file_names}


def test_real_corpus_builder_matches_plain_reading(real_corpus) -> None:
    name, corpus = real_corpus
    plain_test_tokens = read_split_tokens(corpus_spec(name), "test", SHARED_DATA_DIR)
    assert corpus.vocabulary.decode(corpus.test) == plain_test_tokens


def test_limit_vocabulary_keeps_the_most_frequent_training_words():
    from bottleneck.data import TokenizedCorpus, Vocabulary
    from bottleneck.data.tfds_builders import limit_vocabulary

    vocabulary = Vocabulary(["a", "<eos>", "b", "c", "d", "<unk>"])
    encode = vocabulary.encode
    corpus = TokenizedCorpus(
        vocabulary,
        train=encode("a b b c c c d <eos> b c".split()),
        validation=encode("d a <unk> <eos>".split()),
        test=encode("c b a".split()),
    )
    small = limit_vocabulary(corpus, 4)  # <eos>, <unk> and the two most frequent: c (4), b (3)
    assert small.vocabulary.tokens == ("<eos>", "b", "c", "<unk>")  # first-occurrence order
    decode = small.vocabulary.decode
    assert decode(small.train) == "<unk> b b c c c <unk> <eos> b c".split()
    assert decode(small.validation) == "<unk> <unk> <unk> <eos>".split()
    assert decode(small.test) == "c b <unk>".split()
    assert limit_vocabulary(corpus, 6) is corpus and limit_vocabulary(corpus, 100) is corpus

    # A corpus without <unk> gets one; ties keep the earlier word (a before d, both once).
    plain = Vocabulary(["a", "b", "<eos>", "d", "e"])
    corpus = TokenizedCorpus(plain, plain.encode("a b b <eos> d e e a".split()),
                             plain.encode(["d"]), plain.encode(["e"]))  # fmt: skip
    small = limit_vocabulary(corpus, 4)  # a, b and e twice each: the earlier two are kept
    assert small.vocabulary.tokens == ("a", "b", "<eos>", "<unk>")
    assert small.vocabulary.decode(small.validation) == ["<unk>"]
    with pytest.raises(ValueError, match="size must be >= 2"):
        limit_vocabulary(corpus, 1)
