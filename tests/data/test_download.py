"""Downloading the release files (no local directory given): TFDS's download manager against a
loopback HTTP mirror of the fixtures (``$BOTTLENECK_DATA_URL``), SHA-256 checks, errors, reuse."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import shutil
import socket
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from bottleneck.data import (
    DATA_DIR_ENV,
    FIXTURES_DIR,
    ChecksumError,
    DownloadError,
    Ptb,
    Wikitext2,
    load_corpus,
)
from bottleneck.data.corpora import PTB, SPLITS, WIKITEXT2, CorpusSpec
from bottleneck.data.download import DATA_URL_ENV, SHA256SUMS_ENV, expected_sha256
from bottleneck.runs.cli import show_logs

FIXTURE_TEST_TOKENS = {
    "ptb": "a dog sat on the mat <eos> N years ago <eos>",
    "wikitext2": "<eos> It is a game . <eos>",
}
SPECS = [PTB, WIKITEXT2]


def spec_id(spec: CorpusSpec) -> str:
    return spec.name


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fixture_bytes(spec: CorpusSpec) -> dict[str, bytes]:
    return {name: (FIXTURES_DIR / spec.folder / name).read_bytes() for name in spec.file_names}


def closed_loopback_url() -> str:
    """An ``http://127.0.0.1:<port>`` URL on which nothing listens (connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclasses.dataclass
class Mirror:
    """A loopback HTTP server serving the fixtures under the release file names."""

    url: str
    served: Path
    sha256sums: Path
    requests: list[tuple[str, str, int]]  # (method, path, status)

    def serve(self, spec: CorpusSpec, contents: dict[str, bytes]) -> None:
        """Serves ``contents`` (release file name -> bytes) as ``spec``'s download."""
        if spec.archive:
            with zipfile.ZipFile(self.served / spec.archive, "w") as archive:
                archive.writestr(f"{spec.folder}/", b"")
                for name, data in contents.items():
                    archive.writestr(f"{spec.folder}/{name}", data)
        else:
            for name, data in contents.items():
                (self.served / name).write_bytes(data)

    def fetched(self) -> list[str]:
        return [path for method, path, _ in self.requests if method == "GET"]


@pytest.fixture
def mirror(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Mirror:
    """The fixtures served on 127.0.0.1 (``$BOTTLENECK_DATA_URL``) with their own checksums
    (``$BOTTLENECK_DATA_SHA256SUMS``); no local data directory."""
    served = tmp_path / "served"
    served.mkdir()
    sums_lines = []
    for spec in SPECS:
        contents = fixture_bytes(spec)
        sums_lines += [f"{sha256(data)}  {spec.folder}/{name}" for name, data in contents.items()]
    sha256sums = tmp_path / "SHA256SUMS"
    sha256sums.write_text("\n".join(sums_lines) + "\n")
    requests: list[tuple[str, str, int]] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        timeout = 5  # seconds a connection may stay idle

        def log_request(self, code="-", size="-") -> None:
            requests.append((self.command, self.path, int(code)))

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(served))
    )
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    request.addfinalizer(stop)
    mirror = Mirror(f"http://127.0.0.1:{server.server_address[1]}", served, sha256sums, requests)
    for spec in SPECS:
        mirror.serve(spec, fixture_bytes(spec))
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(DATA_URL_ENV, mirror.url)
    monkeypatch.setenv(SHA256SUMS_ENV, str(sha256sums))
    return mirror


def downloaded_files(data_dir: Path) -> list[Path]:
    return [path for path in data_dir.rglob("*") if path.is_file() and "downloads" in path.parts]


def array_records(data_dir: Path) -> list[Path]:
    return list(data_dir.rglob("*.array_record*"))


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_download_prepares_the_corpus_with_digests_and_token_counts(
    spec: CorpusSpec, mirror: Mirror, tmp_path: Path, capsys
):
    show_logs()  # as the scripts do
    corpus = load_corpus(spec.name, data_dir=tmp_path / "tfds")
    assert corpus.vocabulary.decode(corpus.test) == FIXTURE_TEST_TOKENS[spec.name].split()
    assert dict(corpus.sha256) == {name: sha256(d) for name, d in fixture_bytes(spec).items()}
    counts = dict(corpus.token_counts)
    assert list(counts) == list(SPLITS) and counts["test"] == corpus.test.size
    assert not corpus.matches_release
    assert sorted(mirror.fetched()) == sorted(f"/{name}" for name in spec.download_names)
    assert corpus.source == ", ".join(f"{mirror.url}/{name}" for name in spec.download_names)
    err = capsys.readouterr().err
    assert f"Downloading {spec.title} from {mirror.url}/{spec.download_names[0]}" in err
    assert "Unknown size" not in err
    assert downloaded_files(tmp_path / "tfds") == []  # read, checked, deleted


def test_downloaded_corpus_is_reused_without_network(mirror: Mirror, tmp_path, monkeypatch):
    first = load_corpus("wikitext2", data_dir=tmp_path / "tfds")
    monkeypatch.setenv(DATA_URL_ENV, closed_loopback_url())
    again = load_corpus("wikitext2", data_dir=tmp_path / "tfds")
    np.testing.assert_array_equal(again.train, first.train)
    assert again.sha256 == first.sha256 and again.source == first.source


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_checksum_mismatch_names_the_file_and_both_digests_then_the_fixed_file_is_used(
    spec: CorpusSpec, mirror: Mirror, tmp_path: Path
):
    good = fixture_bytes(spec)
    valid_name = spec.split_files["validation"]
    damaged = {**good, valid_name: good[valid_name] + b" one line too many \n"}
    mirror.serve(spec, damaged)
    with pytest.raises(ChecksumError) as error:
        load_corpus(spec.name, data_dir=tmp_path / "tfds")
    message = str(error.value)
    location = f"{mirror.url}/{spec.archive or valid_name}"
    if spec.archive:
        location = f"{valid_name} in {location}"
    assert message.startswith(f"{valid_name} (from {location}) has SHA-256 ")
    assert sha256(damaged[valid_name]) in message and sha256(good[valid_name]) in message
    assert SHA256SUMS_ENV in message
    assert array_records(tmp_path / "tfds") == [] and downloaded_files(tmp_path / "tfds") == []

    mirror.serve(spec, good)
    corpus = load_corpus(spec.name, data_dir=tmp_path / "tfds")
    assert corpus.vocabulary.decode(corpus.test) == FIXTURE_TEST_TOKENS[spec.name].split()
    assert corpus.sha256[valid_name] == sha256(good[valid_name])


def test_default_download_checks_the_published_digests(mirror: Mirror, tmp_path, monkeypatch):
    monkeypatch.delenv(SHA256SUMS_ENV)  # the mirror serves fixtures, not the published files
    assert expected_sha256(PTB) == dict(PTB.sha256)
    with pytest.raises(ChecksumError, match="the published release's") as error:
        load_corpus("ptb", data_dir=tmp_path / "tfds")
    assert PTB.sha256["ptb.train.txt"] in str(error.value)
    assert array_records(tmp_path / "tfds") == []


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_unreachable_host_names_the_url_and_the_offline_alternative(
    spec: CorpusSpec, tmp_path: Path, monkeypatch
):
    url = closed_loopback_url()
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(DATA_URL_ENV, url)
    start = time.monotonic()
    with pytest.raises(DownloadError) as error:
        load_corpus(spec.name, data_dir=tmp_path / "tfds")
    assert time.monotonic() - start < 10  # no retry loop
    message = str(error.value)
    assert f"{url}/{spec.download_names[0]}" in message and "refused" in message
    assert f"${DATA_DIR_ENV} is not set" in message and "--data_dir" in message
    assert all(name in message for name in spec.file_names)
    assert isinstance(error.value, FileNotFoundError)  # handled like missing local files
    assert array_records(tmp_path / "tfds") == []


def test_wikitext_falls_back_to_the_next_release_host(mirror: Mirror, tmp_path, monkeypatch):
    hosts = (closed_loopback_url(), f"{mirror.url}/no-such-folder", mirror.url)
    monkeypatch.setattr(Wikitext2, "CORPUS", dataclasses.replace(WIKITEXT2, release_urls=hosts))
    monkeypatch.delenv(DATA_URL_ENV)
    corpus = load_corpus("wikitext2", data_dir=tmp_path / "tfds")
    assert corpus.source == f"{mirror.url}/wikitext-2-v1.zip"
    assert ("HEAD", "/no-such-folder/wikitext-2-v1.zip", 404) in mirror.requests


def test_local_directory_comes_before_download(mirror: Mirror, tmp_path, monkeypatch):
    explicit = load_corpus("ptb", FIXTURES_DIR, tmp_path / "explicit")
    monkeypatch.setenv(DATA_DIR_ENV, str(FIXTURES_DIR))
    from_env = load_corpus("ptb", data_dir=tmp_path / "env")
    assert mirror.requests == []
    assert explicit.source == from_env.source == str(FIXTURES_DIR / "ptb")


def test_non_utf8_download_fails_naming_the_file(mirror: Mirror, tmp_path: Path) -> None:
    contents = {**fixture_bytes(PTB), "ptb.test.txt": b" a dog \xe9 sat \n"}
    mirror.serve(PTB, contents)
    mirror.sha256sums.write_text(
        "".join(f"{sha256(data)}  {name}\n" for name, data in contents.items())
    )
    with pytest.raises(ValueError, match=f"{mirror.url}/ptb.test.txt is not UTF-8 text"):
        load_corpus("ptb", data_dir=tmp_path / "tfds")
    assert array_records(tmp_path / "tfds") == []


def test_builder_used_directly_downloads_without_manual_dir(mirror: Mirror, tmp_path: Path):
    builder = Ptb(data_dir=str(tmp_path), file_format=tfds.core.FileFormat.ARRAY_RECORD)
    builder.download_and_prepare()
    assert sorted(mirror.fetched()) == sorted(f"/{name}" for name in PTB.file_names)
    assert dict(builder.info.metadata["sha256"]) == expected_sha256(PTB)


def test_mirror_must_be_an_http_url(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv(DATA_URL_ENV, str(FIXTURES_DIR))
    with pytest.raises(ValueError, match=f"not an http\\(s\\) URL.*\\${DATA_DIR_ENV}"):
        load_corpus("ptb", data_dir=tmp_path / "tfds")


def test_checksum_file_must_list_every_release_file(mirror: Mirror, tmp_path: Path) -> None:
    lines = mirror.sha256sums.read_text().splitlines()
    mirror.sha256sums.write_text("\n".join(line for line in lines if "wiki.test" not in line))
    with pytest.raises(ValueError, match="lists no SHA-256 for wiki.test.tokens"):
        load_corpus("wikitext2", data_dir=tmp_path / "tfds")
    mirror.sha256sums.write_text("not a checksum line\n")
    with pytest.raises(ValueError, match="line 1: expected '<sha256>  <file>'"):
        load_corpus("ptb", data_dir=tmp_path / "tfds")
    shutil.rmtree(mirror.served)  # nothing was fetched for either
    assert mirror.requests == []
