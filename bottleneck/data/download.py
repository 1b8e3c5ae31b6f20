"""The corpora's release files over the network: where they are, what they must hash to.

The TFDS builders (:mod:`bottleneck.data.tfds_builders`) download when no local directory is given
(neither ``manual_dir`` nor ``$BOTTLENECK_DATA_DIR``):

* the files come through TFDS's download manager from the release hosts
  (:attr:`~bottleneck.data.corpora.CorpusSpec.release_urls`, tried in order), or from
  ``$BOTTLENECK_DATA_URL``: one ``http(s)`` base URL serving the same file names
  (``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt``, ``wikitext-2-v1.zip``), for mirrors and
  tests;
* every release file used (for WikiText-2, the ``.tokens`` files inside the zip) must have its
  expected SHA-256: the published release's (:attr:`~bottleneck.data.corpora.CorpusSpec.sha256`),
  or, when ``$BOTTLENECK_DATA_SHA256SUMS`` names a file in ``sha256sum`` format, the digests it
  lists (a mirror serving other files, e.g. test fixtures);
* downloads are read into memory and deleted at once, so neither a bad nor a partial download is
  ever used again.
"""

from __future__ import annotations

import io
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from bottleneck.data.corpora import DATA_DIR_ENV, CorpusSpec, sha256_hex

DATA_URL_ENV = "BOTTLENECK_DATA_URL"
SHA256SUMS_ENV = "BOTTLENECK_DATA_SHA256SUMS"
PROBE_TIMEOUT_S = 15.0

logger = logging.getLogger(__name__)


class DownloadError(FileNotFoundError):
    """The release files could not be fetched (host unreachable, HTTP error).

    The message names the URLs tried and the offline alternative. A ``FileNotFoundError``, as for
    missing local files, so code that handles those handles this too.
    """


class ChecksumError(ValueError):
    """A release file does not have its expected SHA-256; the message names the file and both."""


def offline_hint(spec: CorpusSpec) -> str:
    """How to do without the release hosts: a local directory, or a mirror."""
    return (
        f"To work offline, put {', '.join(spec.file_names)} in a directory and pass it "
        f"(--data_dir, `manual_dir`, or ${DATA_DIR_ENV}); or set ${DATA_URL_ENV} to a mirror "
        f"serving {', '.join(spec.download_names)}."
    )


def release_base_urls(spec: CorpusSpec) -> tuple[str, ...]:
    """The base URLs to fetch ``spec.download_names`` from, in order.

    Raises:
        ValueError: ``$BOTTLENECK_DATA_URL`` is set but is not an ``http(s)`` URL.
    """
    mirror = os.environ.get(DATA_URL_ENV, "").strip()
    if not mirror:
        return spec.release_urls
    if urllib.parse.urlparse(mirror).scheme not in ("http", "https"):
        raise ValueError(
            f"${DATA_URL_ENV}={mirror!r} is not an http(s) URL; for files on disk set "
            f"${DATA_DIR_ENV} (or pass --data_dir / `manual_dir`) instead."
        )
    return (mirror.rstrip("/"),)


def parse_sha256sums(text: str, origin: str) -> dict[str, str]:
    """File name (the last path component) -> SHA-256, from ``sha256sum``-format ``text``.

    Blank lines and ``#`` comments are skipped; ``origin`` names the text in messages.

    Raises:
        ValueError: a line is not ``<64 hex digits> <space> [space or *]<path>``.
    """
    digests = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([0-9a-fA-F]{64}) [ *]?(.+)", line)
        if match is None:
            raise ValueError(f"{origin}, line {number}: expected '<sha256>  <file>', got {line!r}")
        digests[PurePosixPath(match[2].strip()).name] = match[1].lower()
    return digests


def expected_sha256(spec: CorpusSpec) -> dict[str, str]:
    """Release file name -> the SHA-256 a downloaded file must have.

    The published digests, unless ``$BOTTLENECK_DATA_SHA256SUMS`` names a checksum file.

    Raises:
        FileNotFoundError: the checksum file does not exist.
        ValueError: the checksum file is malformed or lacks one of ``spec.file_names``.
    """
    sums_path = os.environ.get(SHA256SUMS_ENV, "").strip()
    if not sums_path:
        return dict(spec.sha256)
    origin = f"${SHA256SUMS_ENV} ({sums_path})"
    listed = parse_sha256sums(Path(sums_path).expanduser().read_text("utf-8"), origin)
    missing = [name for name in spec.file_names if name not in listed]
    if missing:
        raise ValueError(f"{origin} lists no SHA-256 for {', '.join(missing)}.")
    return {name: listed[name] for name in spec.file_names}


def digests_key(digests: Mapping[str, str]) -> str:
    """16 hex digits naming a set of files by their digests (the SHA-256 of their manifest)."""
    manifest = "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))
    return sha256_hex(manifest.encode())[:16]


def expected_sha256_origin() -> str:
    """Where :func:`expected_sha256` takes the digests from, for messages."""
    sums_path = os.environ.get(SHA256SUMS_ENV, "").strip()
    return f"listed in ${SHA256SUMS_ENV} ({sums_path})" if sums_path else "the published release's"


def check_sha256(file_name: str, data: bytes, expected: str, where: str, origin: str = "") -> str:
    """The SHA-256 of ``data``, checked to be ``expected``.

    Args:
        file_name: the release file, for messages.
        data: its content.
        expected: the SHA-256 it must have (hex).
        where: where it was read, for messages (``"from <url>"``, ``"in <dir>"``).
        origin: where ``expected`` comes from, for messages.

    Raises:
        ChecksumError: it is not; the message names ``file_name``, ``where`` it came from, and
            both digests.
    """
    actual = sha256_hex(data)
    if actual != expected:
        raise ChecksumError(
            f"{file_name} ({where}) has SHA-256 {actual}, expected {expected}"
            f"{f' ({origin})' if origin else ''}: damaged or not the expected file; "
            "nothing was prepared from it."
        )
    return actual


def _probe(url: str) -> str | None:
    """``None`` if ``url`` answers a HEAD request, else why it does not (fast, no retries)."""
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as err:
        if err.code in (405, 501):  # HEAD not supported: let the download try.
            return None
        return f"HTTP {err.code} {err.reason}"
    except urllib.error.URLError as err:
        return str(err.reason)
    except OSError as err:  # timeouts, resets
        return str(err) or type(err).__name__


def _discard(path: os.PathLike) -> None:
    """Deletes a download and its TFDS ``.INFO`` file, so that it is never reused."""
    path = Path(path)
    for stale in (path, path.with_name(path.name + ".INFO")):
        stale.unlink(missing_ok=True)


def _archive_members(spec: CorpusSpec, data: bytes, url: str) -> dict[str, bytes]:
    """The release files inside a downloaded zip archive (``<spec.folder>/<file name>``)."""
    wanted = {f"{spec.folder}/{name}": name for name in spec.file_names}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = {
                wanted[info.filename]: archive.read(info)
                for info in archive.infolist()
                if info.filename in wanted
            }
    except zipfile.BadZipFile as err:
        raise ValueError(f"{spec.archive} ({url}) is not a valid zip archive: {err}.") from None
    missing = [path for path, name in wanted.items() if name not in members]
    if missing:
        raise ValueError(f"{spec.archive} ({url}) lacks {', '.join(missing)}.")
    return members


class Downloaded(NamedTuple):
    """Release files fetched by :func:`download_release_files`.

    Attributes:
        contents: release file name -> its bytes (SHA-256 checked).
        locations: release file name -> where it came from (its URL, or ``<name> in <zip URL>``).
        source: the URLs downloaded, comma-separated.
    """

    contents: dict[str, bytes]
    locations: dict[str, str]
    source: str


def download_release_files(spec: CorpusSpec, dl_manager, expected: Mapping[str, str]) -> Downloaded:
    """Downloads ``spec``'s release files through ``dl_manager`` and checks their SHA-256.

    Args:
        spec: the corpus.
        dl_manager: the builder's ``tfds.download.DownloadManager``.
        expected: release file name -> SHA-256 each file must have (see :func:`expected_sha256`).

    Returns:
        The files' bytes, where each came from, and the URLs downloaded.

    Raises:
        DownloadError: no base URL serves every file (the message names each URL and why, and the
            offline alternative), or the download failed.
        ChecksumError: a file's SHA-256 is not the expected one.
        ValueError: the WikiText-2 archive is not a zip holding the release files.
    """
    failures = []
    for base in release_base_urls(spec):
        urls = {name: f"{base}/{name}" for name in spec.download_names}
        # Probe first: TFDS retries a refused connection for minutes. One failure per host.
        problem = next(
            (f"{url}: {why}" for url in urls.values() if (why := _probe(url)) is not None), None
        )
        if problem is not None:
            failures.append(problem)
            continue
        source = ", ".join(urls.values())
        logger.info("Downloading %s from %s", spec.title, source)
        try:
            paths = dl_manager.download(urls)
        except Exception as err:
            raise DownloadError(
                f"Downloading {source} failed: {err}. {offline_hint(spec)}"
            ) from err
        try:
            downloaded = {name: Path(path).read_bytes() for name, path in paths.items()}
        finally:
            for path in paths.values():
                _discard(path)
        if spec.archive:
            contents = _archive_members(spec, downloaded[spec.archive], urls[spec.archive])
            locations = {name: f"{name} in {urls[spec.archive]}" for name in spec.file_names}
        else:
            contents = downloaded
            locations = {name: urls[name] for name in spec.file_names}
        origin = expected_sha256_origin()
        for name in spec.file_names:
            check_sha256(name, contents[name], expected[name], f"from {locations[name]}", origin)
        return Downloaded(contents, locations, source)
    raise DownloadError(
        f"Cannot download {spec.title}: {'; '.join(failures)}. No data directory was given and "
        f"${DATA_DIR_ENV} is not set, so the release files were to be downloaded. "
        f"{offline_hint(spec)}"
    )
