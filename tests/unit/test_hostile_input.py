"""Hostile input: whatever the JSON files of a cache hold and whatever kind of file sits where
a file should be, `open` (and everything that reads a cache after it) either succeeds or
raises a documented error (a `ShardsError`), within a time bound; never a hang, never another
exception. protocol.md section 7 states the rules these check."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

import saev_shards as ss

from ..support import strategies
from ..support.caches import small_metadata, write_cache
from ..support.hostile import (
    NEEDS_ROOT,
    NON_REGULAR,
    Pristine,
    Raw,
    cleanup_extras,
    hashed_copy,
    intact_afterwards,
    make_pristine,
    mutate,
    nested,
    open_and_use,
    random_case,
    remove_any,
    render,
    restored,
    time_bound,
)

#: Cases of the random fuzzer: a fast sample in `make test`, at least 10,000 in the slow suite.
FAST_CASES = 400
SLOW_CASES = 10_000


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> list[Pristine]:
    return make_pristine(tmp_path_factory.mktemp("hostile"))


def fuzz_seed() -> int:
    """Fixed under the derandomized CI profile; otherwise a new seed each run, named on failure."""
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        return 0
    return int(os.environ.get("SAEV_FUZZ_SEED", random.randrange(1 << 32)))


def run_fuzz(caches: list[Pristine], n_cases: int, seed: int) -> collections.Counter[str]:
    """Damage one JSON file of one cache per case (mutated or generated), apply the rule, restore."""
    rng = random.Random(seed)
    docs = {c.path: {n: json.loads((c.path / n).read_bytes()) for n in c.json_files} for c in caches}
    sizes = {c.path: {n: (c.path / n).stat().st_size for n in c.json_files} for c in caches}
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(n_cases):
        cache = rng.choice(caches)
        name, data, what = random_case(rng, docs[cache.path], sizes[cache.path])
        check_hash = rng.random() < 0.5
        with restored(cache.path, [name]):
            (cache.path / name).write_bytes(data)
            try:
                outcomes[open_and_use(cache.path, check_hash=check_hash)] += 1
            except Exception as err:
                raise AssertionError(
                    f"case {i} of seed {seed} (SAEV_FUZZ_SEED={seed}), protocol {cache.protocol}, {what}: "
                    f"escaped as {type(err).__name__}: {str(err)[:300]}"
                ) from err
    return outcomes


def test_fuzz_json_files_sample(pristine: list[Pristine]) -> None:
    outcomes = run_fuzz(pristine, FAST_CASES, fuzz_seed())
    assert sum(outcomes.values()) == FAST_CASES
    # The damage reaches past the parser: several kinds of error, and caches that still open.
    assert len(outcomes) >= 5, outcomes
    assert outcomes["JSONFileError"] == 0  # every JSON problem is reported as the file's own kind


@pytest.mark.slow
def test_fuzz_json_files_long(pristine: list[Pristine]) -> None:
    outcomes = run_fuzz(pristine, SLOW_CASES, fuzz_seed() + 1)
    assert sum(outcomes.values()) == SLOW_CASES
    assert len(outcomes) >= 8, outcomes


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=strategies.hostile_cases(n_caches=4, n_files=5))
def test_hostile_mutations_property(pristine: list[Pristine], case: tuple[int, int, str, int, Any, int]) -> None:
    index, file_index, kind, where, value, seed = case
    cache = pristine[index]
    name = cache.json_files[file_index % len(cache.json_files)]
    doc = json.loads((cache.path / name).read_bytes())
    with restored(cache.path, [name]):
        (cache.path / name).write_bytes(mutate(doc, kind, where, value, random.Random(seed)))
        open_and_use(cache.path)


# --------------------------------------------------------------------------------------
# the cases issue 10 reported, one by one


@pytest.fixture
def cache3(pristine: list[Pristine]) -> Iterator[Path]:
    with intact_afterwards(pristine[0].path):
        yield pristine[0].path


@pytest.fixture
def cache2(pristine: list[Pristine]) -> Iterator[Path]:
    with intact_afterwards(pristine[1].path):
        yield pristine[1].path


def write_json(path: Path, value: Any) -> None:
    remove_any(path)
    path.write_text(render(value))


def test_deep_nesting_is_an_error_not_a_recursion(cache3: Path) -> None:
    md = json.loads((cache3 / "metadata.json").read_text())
    for depth in (65, 300, 2_000, 100_000):
        write_json(cache3 / "metadata.json", {**md, "data": nested(depth)})
        with pytest.raises(ss.MetadataFileError, match=r"nested deeper than 64 levels|depth limit exceeded"):
            ss.open(cache3, check_hash=False)
    write_json(cache3 / "metadata.json", md)
    manifest = json.loads((cache3 / "shards.json").read_text())
    write_json(cache3 / "shards.json", {**manifest, "columns": {"lengths": nested(5_000, brackets="{}")}})
    with pytest.raises(ss.ManifestError, match=r"nested deeper than 64 levels|depth limit exceeded"):
        ss.open(cache3)


def test_data_at_the_depth_limit_opens(root: Path) -> None:
    data: Any = {"leaf": 1}
    for _ in range(62):  # data is inside the metadata object: 63 levels, 64 with it
        data = {"k": data}
    md = small_metadata(data=data, n_examples=3)
    write_cache(root, md)
    assert ss.open(root / md.hash).metadata.data == data
    with pytest.raises(ss.MetadataError, match="data: nested deeper than 64 levels"):
        small_metadata(data={"k": data})


def test_repeated_keys_are_rejected_in_every_json_file(cache3: Path, cache2: Path) -> None:
    manifest = json.loads((cache3 / "shards.json").read_text())
    entry = manifest["shards"][1]
    repeated = Raw(render(entry)[:-1] + ', "n_examples": 5}')  # the same key, the same value
    shards = [manifest["shards"][0], repeated, *manifest["shards"][2:]]
    write_json(cache3 / "shards.json", {**manifest, "shards": shards})
    with pytest.raises(ss.ManifestError, match="duplicate key 'n_examples'"):
        ss.open(cache3)
    write_json(cache3 / "shards.json", Raw(render(manifest)[:-1] + ', "stats": null}'))
    with pytest.raises(ss.ManifestError, match="duplicate key 'stats'"):
        ss.open(cache3)
    sidecar = json.loads((cache2 / "checksums.json").read_text())
    write_json(cache2 / "checksums.json", Raw(render(sidecar)[:-1] + ', "files": {}}'))
    with pytest.raises(ss.ManifestError, match=r"checksums\.json: duplicate key 'files'"):
        ss.open(cache2)


def test_nul_and_paths_in_legacy_names_never_reach_a_system_call(cache2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    for fn in ("stat", "lstat", "open"):
        original = getattr(os, fn)

        def spy(path: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            seen.append(os.fsdecode(path) if not isinstance(path, int) else str(path))
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(os, fn, spy)
    manifest = json.loads((cache2 / "shards.json").read_text())
    for name in ("acts000000.bin\x00", "\x00", "../../etc/passwd", "/etc/passwd", "acts000000.bin/.."):
        manifest[0]["name"] = name
        manifest[-1]["name"] = name  # the last shard's size is probed (padded or not)
        write_json(cache2 / "shards.json", manifest)
        with pytest.raises(ss.InvalidCacheError, match=r"expected name 'acts000000\.bin'"):
            ss.open(cache2)
    assert not [p for p in seen if "\x00" in p or "passwd" in p or p.endswith("..")]


@pytest.mark.filterwarnings("ignore::saev_shards.ProtocolWarning")
def test_legacy_extra_shard_is_flagged_but_a_listed_trailing_empty_one_is_not(cache2: Path) -> None:
    shutil.copy(cache2 / "acts000000.bin", cache2 / "acts000009.bin")
    with pytest.raises(ss.UnexpectedFileError, match=r"acts000009\.bin: data file not listed in shards\.json"):
        ss.open(cache2)
    (cache2 / "acts000009.bin").unlink()
    # The saev reference lists a trailing all-zero shard with n_examples 0 when the examples
    # fill the last shard exactly: that file is listed, so it is not unexpected.
    md = ss.open(cache2).metadata
    trailing = f"acts{md.n_shards:06d}.bin"
    shutil.copy(cache2 / "acts000000.bin", cache2 / trailing)
    manifest = json.loads((cache2 / "shards.json").read_text())
    write_json(cache2 / "shards.json", [*manifest, {"name": trailing, "n_examples": 0}])
    assert ss.open(cache2).n_shards == md.n_shards
    write_json(cache2 / "shards.json", [*manifest, {"name": "acts000042.bin", "n_examples": 0}])
    with pytest.raises(ss.InvalidCacheError, match=rf"expected name '{trailing}', found 'acts000042.bin'"):
        ss.open(cache2)


def test_stats_json_is_schema_checked_when_read_and_by_verify(cache3: Path) -> None:
    good = json.loads((cache3 / "stats.json").read_text())
    size = (cache3 / "stats.json").stat().st_size
    shards = ss.open(cache3)
    assert shards.stats is not None and shards.stats["mean"].shape == (2, 8)
    bad_cases = {
        "missing keys ['var']": {k: v for k, v in good.items() if k != "var"},
        "unknown keys ['extra']": {**good, "extra": 1},
        "layers: expected [6, 11]": {**good, "layers": [6, 12]},
        "count: expected 2 integers >= 0": {**good, "count": [1, -1]},
        "nonfinite: expected 2 integers": {**good, "nonfinite": [0]},
        "mean: expected 2 arrays of 8 numbers": {**good, "mean": good["mean"][:1]},
        "var: expected 2 arrays of 8 numbers": {**good, "var": [row[:-1] for row in good["var"]]},
        "norm_mean: expected 2 numbers": {**good, "norm_mean": ["1.5", 2.0]},
        "norm_sq_mean: expected 2 numbers": {**good, "norm_sq_mean": [True, 2.0]},
    }
    for message, bad in bad_cases.items():
        # Same size as the original, so open's size check passes and the schema is what fails.
        text = json.dumps(bad).encode()
        (cache3 / "stats.json").write_bytes(text + b" " * (size - len(text)))
        shards = ss.open(cache3)
        with pytest.raises(ss.StatsFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
            shards.stats  # noqa: B018
        with pytest.raises(ss.InvalidCacheError) as info:
            shards.verify()  # the checksum fails first; the schema is checked on intact bytes
        assert ss.ChecksumMismatchError in {p.kind for p in info.value.problems}


def test_size_caps_are_checked_before_reading(cache3: Path) -> None:
    path = cache3 / "metadata.json"
    remove_any(path)
    with path.open("wb") as f:
        f.truncate(ss.protocol.MAX_METADATA_BYTES + 1)  # sparse: nothing to read, only its size
    with pytest.raises(ss.MetadataFileError, match=r"expected at most 16,777,216 bytes, found 16,777,217"):
        ss.open(cache3)


# --------------------------------------------------------------------------------------
# files that are not regular files, and symbolic links


def _cases() -> list[tuple[int, str, str]]:
    files3 = ["metadata.json", "shards.json", "stats.json", "acts000000.bin", "labels.bin", "column.lengths.bin",
              "text.prompt.jsonl"]  # fmt: skip
    files2 = ["metadata.json", "shards.json", "checksums.json", "acts000000.bin", "labels.bin"]
    return [(i, name, kind) for i, files in enumerate((files3, files2)) for name in files for kind in NON_REGULAR]


@pytest.mark.parametrize(("index", "name", "kind"), _cases())
def test_non_regular_files_are_documented_errors(pristine: list[Pristine], index: int, name: str, kind: str) -> None:
    if kind in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip(f"creating a {kind} needs root")
    cache = pristine[index].path
    with restored(cache, [name]):
        original = (cache / name).read_bytes()
        remove_any(cache / name)
        NON_REGULAR[kind](cache / name, original)
        try:
            with pytest.raises(ss.ShardsError) as info, time_bound(20, f"open with {name} as a {kind}"):
                ss.open(cache)
        finally:
            cleanup_extras(cache)
    message = str(info.value)
    assert str(cache / name) in message
    if "symlink" in kind:
        assert "expected a regular file, found a symbolic link" in message
    assert isinstance(info.value, ss.InvalidCacheError)


def test_missing_checksums_json_is_fine_but_a_dangling_link_is_not(cache2: Path) -> None:
    (cache2 / "checksums.json").unlink()
    with pytest.warns(ss.ProtocolWarning):
        ss.open(cache2)
    (cache2 / "checksums.json").symlink_to("gone.json")
    with pytest.raises(ss.ManifestError, match=r"checksums\.json: expected a regular file, found a symbolic link"):
        ss.open(cache2)


def test_a_cache_reached_through_symlinks_opens_at_its_real_path(pristine: list[Pristine], tmp_path: Path) -> None:
    real = pristine[0].path
    link = tmp_path / "links" / "train-shards"
    link.parent.mkdir()
    link.symlink_to(real)
    shards = ss.open(link)
    assert shards.path == real  # resolved once; the real directory's name is the hash
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ss.CacheNotFoundError):
        ss.open(loop)


def test_file_symlinks_are_rejected_even_inside_the_cache(cache3: Path) -> None:
    shutil.copy(cache3 / "labels.bin", cache3 / "copy-of-labels.bin")
    (cache3 / "labels.bin").unlink()
    (cache3 / "labels.bin").symlink_to("copy-of-labels.bin")
    with pytest.raises(ss.ManifestError, match=r"labels\.bin: expected a regular file, found a symbolic link"):
        ss.open(cache3)


# --------------------------------------------------------------------------------------
# values: what metadata.json may hold


def test_values_json_tools_cannot_hold_are_rejected(pristine: list[Pristine], tmp_path: Path) -> None:
    md = json.loads((pristine[0].path / "metadata.json").read_text())
    cases = {
        "integer 18446744073709551616 does not fit 64 bits": {**md, "data": {"n": 2**64}},
        "integer -9223372036854775809 does not fit 64 bits": {**md, "data": {"n": [-(2**63) - 1]}},
        "layers: expected integers within signed 64 bits": {**md, "layers": [6, 2**63]},
        "no low surrogate": Raw(render({**md, "family": "X"}).replace('"X"', '"\\ud800"')),
    }
    for i, (message, metadata) in enumerate(cases.items()):
        root = tmp_path / str(i)
        root.mkdir()
        path = hashed_copy(pristine[0].path, root, metadata)
        with pytest.raises(ss.MetadataFileError, match=message):
            ss.open(path)


def test_extreme_but_valid_values_open(pristine: list[Pristine], tmp_path: Path) -> None:
    md = json.loads((pristine[0].path / "metadata.json").read_text())
    metadata = {**md, "ckpt": "\x1b]0;title\x07\x00", "data": {"n": 2**64 - 1, "m": -(2**63), "x": 1e308}}
    path = hashed_copy(pristine[0].path, tmp_path, metadata)
    shards = ss.open(path)
    assert shards.metadata.data["n"] == 2**64 - 1
    assert shards.metadata.ckpt == "\x1b]0;title\x07\x00"
    assert ss.open(path).metadata.hash == path.name


def test_a_fifo_is_never_opened(cache3: Path) -> None:
    (cache3 / "metadata.json").unlink()
    os.mkfifo(cache3 / "metadata.json")
    assert stat.S_ISFIFO(os.lstat(cache3 / "metadata.json").st_mode)
    with time_bound(10, "open with a FIFO"), pytest.raises(ss.MetadataFileError, match="found a FIFO"):
        ss.open(cache3)


def test_verify_after_a_file_is_swapped_never_follows_or_blocks(cache3: Path) -> None:
    shards = ss.open(cache3)
    (cache3 / "acts000001.bin").unlink()
    os.mkfifo(cache3 / "acts000001.bin")
    (cache3 / "labels.bin").rename(cache3 / "elsewhere.bin")
    (cache3 / "labels.bin").symlink_to("elsewhere.bin")
    with time_bound(10, "verify with a FIFO shard"), pytest.raises(ss.ManifestError) as info:
        shards.verify()
    message = str(info.value)
    assert "acts000001.bin: expected a regular file, found a FIFO" in message
    assert "labels.bin: expected a regular file, found a symbolic link" in message
