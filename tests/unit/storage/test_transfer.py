"""The one transfer routine (`storage.transfer`): every byte hashed on its way through one
`BlockHasher`, one wording for what differs, and copies that resume from what an
interrupted copy left, from a local or a remote source alike."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import ChecksumMismatchError, FileSizeError
from saev_shards.fileio import BlockHasher
from saev_shards.storage import Files
from saev_shards.storage.transfer import StreamDigest, TransferReport, copy_file, resume_file

from .test_base import DATA, _storages

ROW = ("f.bin", len(DATA), xxhash.xxh3_128_hexdigest(DATA))


@given(cuts=st.lists(st.integers(0, len(DATA)), max_size=6), block_size=st.none() | st.integers(1, 4096))
def test_stream_digest_equals_the_hasher_over_the_whole(cuts: list[int], block_size: int | None) -> None:
    """However a stream is cut into pieces (and passed in several turns), the digests are the
    one hasher's over the whole, every piece is handed on unchanged and ticked after."""
    bounds = [0, *sorted(cuts), len(DATA)]
    pieces = [DATA[a:b] for a, b in itertools.pairwise(bounds)]
    ticks: list[int] = []
    seen = StreamDigest(ticks.append, block_size)
    half = len(pieces) // 2
    out = b"".join(bytes(v) for v in seen.through(pieces[:half]))
    seen.drain(pieces[half:])
    want = BlockHasher(block_size)
    want.update(DATA)
    assert out == b"".join(pieces[:half])
    assert (seen.nbytes, seen.digest, seen.block_digests()) == (len(DATA), want.hexdigest(), want.block_hexdigests())
    assert ticks == [len(p) for p in pieces] and seen.mismatch(len(DATA), want.hexdigest()) is None


def test_one_wording_for_what_differs() -> None:
    seen = StreamDigest().drain([b"abc"])
    assert seen.mismatch(2, None) == "expected 2 bytes, found more"
    assert seen.mismatch(4, None) == "expected 4 bytes, found 3"
    assert seen.mismatch(3, "0" * 32) == f"xxh3_128 expected {'0' * 32}, found {seen.digest}"
    assert seen.mismatch(3, None) is None


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_a_copy_resumes_from_what_an_interrupted_one_left(tmp_path: Path, kind: str) -> None:
    files: Files = _storages(tmp_path / "source", kind)
    dest = tmp_path / "dest"
    dest.mkdir()
    dst = dest / "f.bin"
    dst.write_bytes(DATA[:2500])  # half-written
    report = TransferReport(source=tmp_path, dest=dest)
    assert resume_file(files, ROW, dst, report, lambda n: None, durable=False)
    assert dst.read_bytes() == DATA and (report.resumed_files, report.kept_bytes) == (1, 2500)
    assert resume_file(files, ROW, dst, report, lambda n: None, durable=False)  # complete: kept
    assert report.kept_files == 1
    dst.write_bytes(b"x" + DATA[1:2500])  # a damaged start: not usable, copied again by the caller
    assert not resume_file(files, ROW, dst, report, lambda n: None, durable=False)
    dst.write_bytes(DATA + b"more")
    assert not resume_file(files, ROW, dst, report, lambda n: None, durable=False)
    files.close_all()


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_a_source_that_does_not_match_its_manifest_is_named(tmp_path: Path, kind: str) -> None:
    files: Files = _storages(tmp_path / "source", kind)
    dst = tmp_path / "copy.bin"
    with pytest.raises(ChecksumMismatchError, match=r"f\.bin: xxh3_128 expected 0{32}, found .* while copying it"):
        copy_file(files, ("f.bin", len(DATA), "0" * 32), dst, lambda n: None, durable=False)
    assert not dst.exists()
    with pytest.raises(FileSizeError, match=rf"f\.bin: expected {len(DATA) - 1} bytes, found more"):
        copy_file(files, ("f.bin", len(DATA) - 1, None), dst, lambda n: None, durable=False)
    with pytest.raises(FileSizeError, match=rf"f\.bin: expected {len(DATA) + 1} bytes, found {len(DATA)}"):
        copy_file(files, ("f.bin", len(DATA) + 1, None), dst, lambda n: None, durable=False)
    files.close_all()


def test_the_report_keeps_its_earlier_names(tmp_path: Path) -> None:
    report = TransferReport(source=tmp_path, dest="s3://bucket/root/abc")
    report.copied_files, report.copied_bytes, report.recopied = 2, 10, ["a"]
    report.already_there = True
    assert (report.uploaded_files, report.uploaded_bytes, report.replaced) == (2, 10, ["a"])
    assert report.already_pushed and report.already_staged and report.url == "s3://bucket/root/abc"
    assert TransferReport(source=tmp_path, dest=tmp_path / "x").path == tmp_path / "x"
