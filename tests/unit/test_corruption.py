"""Damaged data files: a bit flipped anywhere in any data file is caught by `verify`, and a
file one byte too long or too short is caught by `open` without reading any data."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import saev_shards as ss

from ..support.hostile import Pristine, make_pristine, time_bound, writable

#: Bit flips per data file: a fast sample (first, last, middle, and random bytes) in `make
#: test`; in the slow suite every byte of files up to SLOW_FLIPS bytes, and SLOW_FLIPS bytes
#: spread over larger ones.
FAST_FLIPS = 8
SLOW_FLIPS = 256


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> list[Pristine]:
    return make_pristine(tmp_path_factory.mktemp("corruption"))


def data_files(caches: list[Pristine]) -> Iterator[tuple[Path, str]]:
    for cache in caches:
        for name in cache.data_files:
            yield cache.path, name


def flip_and_verify(cache: Path, name: str, positions: list[int], rng: random.Random) -> int:
    """Flip one bit at each position of ``cache/name`` in turn; `verify` must name that file each time."""
    path = cache / name
    original = path.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        shards = ss.open(cache)
    for pos in positions:
        data = bytearray(original)
        data[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            with time_bound(20, f"verify {name} flipped at byte {pos}"), pytest.raises(ss.InvalidCacheError) as info:
                shards.verify()
        finally:
            path.write_bytes(original)
        caught = [p for p in info.value.problems if p.kind is ss.ChecksumMismatchError]
        assert [p.message.split(": ")[0] for p in caught] == [str(path)], (name, pos, info.value.problems)
    shards.verify()  # restored: everything matches again
    return len(positions)


def test_bit_flips_in_every_data_file_are_caught_by_verify(pristine: list[Pristine]) -> None:
    rng = random.Random(0)
    flipped = 0
    for cache, name in data_files(pristine):
        size = (cache / name).stat().st_size
        positions = sorted({0, size - 1, size // 2, *(rng.randrange(size) for _ in range(FAST_FLIPS - 3))})
        flipped += flip_and_verify(cache, name, positions, rng)
    # 10 data files in the 3.1 float16 cache (blocks.json among them), 3 in the 2.1 one, 15 in
    # the float8_e4m3 one (5 scale files), 9 in the 3.0 one
    assert flipped >= 37 * 4


@pytest.mark.slow
def test_bit_flips_all_over_every_data_file_are_caught(pristine: list[Pristine]) -> None:
    rng = random.Random(1)
    flipped = 0
    for cache, name in data_files(pristine):
        size = (cache / name).stat().st_size
        positions = sorted({size * i // SLOW_FLIPS for i in range(SLOW_FLIPS)} | {size - 1})
        flipped += flip_and_verify(cache, name, positions, rng)
    assert flipped > 2_500


# `open` in a fresh interpreter that records every file it opens (audit events): a size
# error must come from the directory listing and stat alone.
_OPEN_WITHOUT_READING = textwrap.dedent(
    """
    import json, os, sys, warnings
    import saev_shards as ss

    opened = []
    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.path.basename(os.fsdecode(args[0])))
    sys.addaudithook(hook)
    warnings.simplefilter("ignore")
    out = []
    for path in json.loads(sys.argv[1]):
        del opened[:]
        try:
            ss.open(path)
            out.append({"error": None, "opened": list(opened)})
        except ss.ShardsError as err:
            out.append({"error": type(err).__name__, "message": str(err), "opened": list(opened)})
    print(json.dumps(out))
    """
)


def test_one_byte_more_or_less_in_any_data_file_is_caught_by_open_without_reading_data(
    pristine: list[Pristine], tmp_path: Path
) -> None:
    cases = []
    for i, (cache, name) in enumerate(data_files(pristine)):
        for delta in (+1, -1):
            copy = tmp_path / f"{i}{'+' if delta > 0 else '-'}" / cache.name
            shutil.copytree(cache, copy)
            writable(copy)
            data = (copy / name).read_bytes()
            (copy / name).write_bytes(data + b"\0" if delta > 0 else data[:-1])
            cases.append((copy, name))
    proc = subprocess.run(
        [sys.executable, "-c", _OPEN_WITHOUT_READING, json.dumps([str(c) for c, _ in cases])],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    results = json.loads(proc.stdout)
    assert len(results) == len(cases) == 2 * 37  # every data file of the four caches (test above)
    json_files = {"metadata.json", "shards.json", "checksums.json"}
    for (copy, name), result in zip(cases, results, strict=True):
        assert result["error"] == "FileSizeError", (copy, name, result)
        assert f"{copy / name}: expected " in result["message"]
        assert set(result["opened"]) <= json_files | {copy.name}, (name, result["opened"])


def test_damaged_text_reads_as_documented_errors(pristine: list[Pristine]) -> None:
    """Reading a damaged text file (before any `verify`) gives values or a ShardsError."""
    cache = pristine[0].path
    path = cache / "text.prompt.jsonl"
    original = path.read_bytes()
    outcomes = set()
    shards = ss.open(cache)
    try:
        for pos in range(0, len(original), 5):
            for byte in (ord("\n"), ord('"'), 0xFF):
                data = bytearray(original)
                data[pos] = byte
                path.write_bytes(bytes(data))
                text = shards.text("prompt")  # a new reader of the file each time
                try:
                    list(text)
                    text[len(text) - 1]
                    outcomes.add("read")
                except ss.ShardsError as err:
                    outcomes.add(type(err).__name__)
    finally:
        path.write_bytes(original)
    assert outcomes <= {"read", "InvalidCacheError", "ManifestError"}
    assert len(outcomes) >= 2, outcomes
