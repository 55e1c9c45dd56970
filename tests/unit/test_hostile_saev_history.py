"""The hostile-input rules (protocol.md section 7) over saev's earlier formats (protocol.md 9.5).

Whatever their metadata.json and shards.json hold, and whatever sits where a data file should
be, opening and reading a cache of any of saev's earlier formats either succeeds or raises a
documented `ShardsError`, in bounded time: the suite of `test_hostile_input`, run over a
writable copy of every fixture under tests/data/saev-history and of caches whose examples fill
the last shard exactly (the all-zero file after them, with and without a shards.json).
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import saev_shards as ss

from ..support import saev_history as hist
from ..support import strategies
from ..support.hostile import (
    NEEDS_ROOT,
    NON_REGULAR,
    Pristine,
    cleanup_extras,
    mutate,
    open_and_use,
    random_case,
    remove_any,
    restored,
    time_bound,
    writable,
)

FAST_CASES = 300
SLOW_CASES = 5_000


def exact_fill(root: Path, folder: str) -> Path:
    """A cache of ``folder``'s format of 6 examples, 3 per shard: the writer's all-zero third file."""
    fmt = hist.FORMATS[folder]
    fields = hist.fields_for(fmt, layers=[-1, 3], patches=2, cls_token=False, d=3, n=6, budget=12)
    acts = np.arange(6 * 2 * 2 * 3, dtype=np.float32).reshape(6, 2, 2, 3) - 20
    return hist.build(root, fmt, fields, acts)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> list[Pristine]:
    base = tmp_path_factory.mktemp("hostile-history")
    caches = [shutil.copytree(cache, base / cache.name) for _, cache, _ in hist.fixtures()]
    caches += [exact_fill(base / "fill", "0.1.0-pypi"), exact_fill(base / "fill", "1.1-pixel_agg")]
    out = []
    for path in caches:
        writable(path)
        names = sorted(p.name for p in path.iterdir())
        json_files = tuple(n for n in names if n.endswith(".json"))
        data_files = tuple(n for n in names if n.endswith(".bin"))
        protocol = json.loads((path / "metadata.json").read_bytes()).get("protocol", "none")
        out.append(Pristine(path, protocol, json_files, data_files))
    return out


def run_fuzz(caches: list[Pristine], n_cases: int, seed: int) -> collections.Counter[str]:
    rng = random.Random(seed)
    docs = {c.path: {n: json.loads((c.path / n).read_bytes()) for n in c.json_files} for c in caches}
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(n_cases):
        cache = rng.choice(caches)
        name, data, what = random_case(rng, docs[cache.path])
        check_hash = rng.random() < 0.5
        with restored(cache.path, [name]):
            (cache.path / name).write_bytes(data)
            try:
                outcomes[open_and_use(cache.path, check_hash=check_hash)] += 1
            except Exception as err:
                raise AssertionError(
                    f"case {i} of seed {seed}, {cache.path.name[:12]} ({cache.protocol}), {what}: "
                    f"escaped as {type(err).__name__}: {str(err)[:300]}"
                ) from err
    return outcomes


def test_fuzz_json_files_of_every_old_format(pristine: list[Pristine]) -> None:
    seed = 0 if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else random.randrange(1 << 32)
    outcomes = run_fuzz(pristine, FAST_CASES, seed)
    assert sum(outcomes.values()) == FAST_CASES
    assert len(outcomes) >= 4, outcomes
    assert outcomes["JSONFileError"] == 0  # reported as the file's own kind


@pytest.mark.slow
def test_fuzz_json_files_of_every_old_format_long(pristine: list[Pristine]) -> None:
    outcomes = run_fuzz(pristine, SLOW_CASES, random.randrange(1 << 32))
    assert sum(outcomes.values()) == SLOW_CASES


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=strategies.hostile_cases(n_caches=12, n_files=2))
def test_hostile_mutations_of_old_formats(pristine: list[Pristine], case: tuple[int, int, str, int, Any, int]) -> None:
    index, file_index, kind, where, value, seed = case
    cache = pristine[index % len(pristine)]
    name = cache.json_files[file_index % len(cache.json_files)]
    doc = json.loads((cache.path / name).read_bytes())
    with restored(cache.path, [name]):
        (cache.path / name).write_bytes(mutate(doc, kind, where, value, random.Random(seed)))
        open_and_use(cache.path)


def _cases() -> list[tuple[str, str, str]]:
    """(cache, file, kind): metadata.json and shards.json, a full shard, the padded last one,
    labels.bin, and the all-zero file after an exact fill (unlisted before 1.0.0)."""
    pre = "b080fc712ec2"  # saev 0.1.0: no shards.json
    v20 = "6dcc38878aff"  # saev 2.0, 3 layers, labels
    files = [(pre, "metadata.json"), (pre, "acts000000.bin"), (pre, "acts000002.bin"), (v20, "shards.json"),
             (v20, "acts000004.bin"), (v20, "labels.bin"), ("fill-0.1.0-pypi", "acts000002.bin"),
             ("fill-1.1-pixel_agg", "acts000002.bin")]  # fmt: skip
    return [(c, n, kind) for c, n in files for kind in NON_REGULAR]


def _find(pristine: list[Pristine], key: str) -> Path:
    if key.startswith("fill-"):
        fmt = hist.FORMATS[key.removeprefix("fill-")]
        return next(c.path for c in pristine if c.path.parent.name == "fill" and c.protocol == (fmt.protocol or "none"))
    return next(c.path for c in pristine if c.path.name.startswith(key))


@pytest.mark.parametrize(("key", "name", "kind"), _cases())
def test_non_regular_files_are_documented_errors(pristine: list[Pristine], key: str, name: str, kind: str) -> None:
    if kind in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip(f"creating a {kind} needs root")
    cache = _find(pristine, key)
    with restored(cache, [name]):
        original = (cache / name).read_bytes()
        remove_any(cache / name)
        NON_REGULAR[kind](cache / name, original)
        try:
            with pytest.raises(ss.ShardsError) as info, time_bound(20, f"open with {name} as a {kind}"):
                open_and_raise(cache)
        finally:
            cleanup_extras(cache)
    assert str(cache / name) in str(info.value)
    assert isinstance(info.value, ss.InvalidCacheError)


def open_and_raise(path: Path) -> None:
    """`open`, then `verify` (the rule's whole path); an error propagates."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards = ss.open(path)
        try:
            shards.verify()
        finally:
            shards.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_all_zero_file_after_an_exact_fill(pristine: list[Pristine]) -> None:
    """Before 1.0.0 nothing lists it: present (full size, or emptied) or absent, the cache reads
    the same; any other length is refused, and verify checks it is zeros."""
    cache = _find(pristine, "fill-0.1.0-pypi")
    empty = cache / "acts000002.bin"
    with restored(cache, ["acts000002.bin"]):
        for size in (None, 0, 144):  # absent, emptied by hand, as written
            remove_any(empty)
            if size is not None:
                empty.write_bytes(bytes(size))
            shards = ss.open(cache)
            assert len(shards.manifest.empty_shards) == (0 if size is None else 1) and len(shards) == 6
            shards.verify()
            shards.close()
        empty.write_bytes(bytes(143))
        with pytest.raises(ss.FileSizeError, match=r"acts000002\.bin: expected 144 bytes, found 143"):
            ss.open(cache)
        empty.write_bytes(bytes(100) + b"\x07" + bytes(43))
        shards = ss.open(cache)
        with pytest.raises(ss.ChecksumMismatchError, match=r"acts000002\.bin: byte 100 is not zero; bytes 0-143"):
            shards.verify()
        shards.close()
