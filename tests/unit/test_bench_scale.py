"""`benchmarks/scale.py` and its cgroup helper (`benchmarks/cgroup.py`): the limit is a quarter of
the cache, the sparse caches are caches (their digests verify), growth is named from the
figures, the children's results come back, and where no memory limit can be set the suite
says so instead of failing. No timing is asserted: the figures themselves are the benchmark's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from benchmarks import benchlib, cgroup, tables
from benchmarks import scale as bench

GIB = 1 << 30


def test_the_limit_is_a_quarter_of_the_cache_page_aligned_with_a_floor() -> None:
    assert bench.limit_for(16 * GIB) == 4 * GIB
    assert bench.limit_for(16 * GIB + 12345) % 4096 == 0
    assert bench.limit_for(10**6) == bench.MIN_LIMIT


@pytest.mark.parametrize("limit", [bench.MIN_LIMIT, 2 * GIB, 4 * GIB, 64 * GIB])
def test_two_windows_fit_in_half_the_limit(limit: int) -> None:
    window = bench.window_for(limit)
    assert 2 * window <= limit // 2 and window <= GIB


def test_the_default_run_spans_1_gb_to_10_tb_and_the_options_scale_it() -> None:
    quick, default, big = bench.sizes_for(True, False), bench.sizes_for(False, False), bench.sizes_for(False, True)
    assert default.sparse_bytes[0] == 10**9 and default.sparse_bytes[-1] == 10**13
    assert quick.cold_bytes < default.cold_bytes < big.cold_bytes
    assert quick.rounds <= default.rounds <= big.rounds
    assert bench.limit_for(big.cold_bytes) < big.cold_bytes  # past the limit: the page cache cannot hold it


@pytest.mark.parametrize("nbytes", [10**9, 10**11, 10**13])
def test_scaled_metadata_has_the_size_asked(nbytes: int) -> None:
    md = bench.scaled_metadata(nbytes, "t")
    assert abs(md.nbytes - nbytes) <= md.example_nbytes
    if nbytes == 10**13:
        assert 30_000 < md.n_shards < 36_000  # the 10 TB cache: ~33,000 shards


def test_growth_names_constant_shards_and_tokens() -> None:
    assert bench.growth([0.5, 0.52, 0.7], 0.6, 4, 1e-3) == "constant"  # less than doubles over the sizes
    assert bench.growth([0.0, 0.0, 2e-4], 0.0, 4, 1e-3) == "constant"  # under the clock's resolution
    assert bench.growth([0.01, 0.1, 10.0], 2.5, 4, 1e-3) == "linear in shards"  # a quarter of the shards: a quarter
    assert bench.growth([0.01, 0.1, 10.0], 9.0, 4, 1e-3) == "linear in tokens"  # as many tokens: as much
    assert bench.growth([338.0, 338.0, 338.0], 338.0, 4, 1.0) == "constant"


def test_parse_result_takes_the_last_result_line() -> None:
    out = 'noise\nRESULT {"a": 1}\nmore\nRESULT {"a": 2, "b": 0.5}\n'
    assert bench.parse_result(out) == {"a": 2.0, "b": 0.5}
    with pytest.raises(RuntimeError, match="no result"):
        bench.parse_result("Traceback ...\n")


def test_median_rows_and_ratio() -> None:
    rows = [{"x": 1.0, "y": 4.0}, {"x": 3.0, "y": 2.0}, {"x": 2.0, "y": 3.0}]
    assert bench.median_rows(rows) == {"x": 2.0, "y": 3.0}
    assert bench.ratio(1.0, 2.0) == 0.5
    assert np.isnan(bench.ratio(1.0, float("nan"))) and np.isnan(bench.ratio(1.0, 0.0))


def test_a_sparse_cache_is_a_cache_of_zeros_with_true_digests(tmp_path: Path) -> None:
    md = bench.scaled_metadata(60 << 20, "t", patches_per_shard=4 * 196)  # several shards, several 16 MiB blocks
    path = bench.sparse_cache(tmp_path, md)
    shards = ss.open(path)
    assert shards.n_shards == md.n_shards > 2 and shards.n_examples == md.n_examples
    assert shards.verify() >= md.nbytes  # every digest checked (the shards and the JSON files): the zeros' own
    assert not np.asarray(shards.read_example_raw(md.n_examples - 1, 1)).any()
    on_disk = sum(os.stat(shards.shard_path(k)).st_blocks * 512 for k in range(shards.n_shards))
    assert on_disk < md.nbytes // 10  # holes, not data
    assert bench.sparse_cache(tmp_path, md) == path  # made once
    shards.close()


def test_a_child_runs_a_job_and_its_figures_come_back(tmp_path: Path) -> None:
    data = tmp_path / "f.bin"
    data.write_bytes(b"x" * 100_000)
    got = bench.in_child("read", None, files=[str(data)], write_to=str(tmp_path / "w.bin"), write_bytes=5000)
    assert got["read_bytes"] == 100_000 and got["write_s"] >= 0
    assert not (tmp_path / "w.bin").exists()
    with pytest.raises(RuntimeError, match="read child failed"):
        bench.in_child("read", None, files=[str(tmp_path / "missing")])


def test_without_a_memory_limit_the_suite_says_so_and_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAEV_RESULTS_DIR", str(tmp_path))

    def unavailable(*args: Any, **kwargs: Any) -> cgroup.MemoryLimit:
        raise cgroup.Unavailable("no cgroup v2 hierarchy mounted")

    monkeypatch.setattr(cgroup.MemoryLimit, "create", unavailable)
    fake: Any = SimpleNamespace(metadata=SimpleNamespace(nbytes=GIB))
    mark = len(tables.emitted_since(0))
    bench.bench_shuffle(fake, bench.sizes_for(True, False), tmp_path / "out")
    bench.bench_cold([fake], bench.sizes_for(True, False))
    emitted = tables.emitted_since(mark)
    assert len(emitted) == 2
    assert all("Skipped: no memory limit can be set here (no cgroup v2 hierarchy mounted)" in t for t in emitted)


def test_without_room_for_the_shuffle_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAEV_RESULTS_DIR", str(tmp_path))
    removed: list[bool] = []
    limit = SimpleNamespace(limit=GIB, kind="cgroup v2 memory.max", remove=lambda: removed.append(True))
    monkeypatch.setattr(bench, "limited", lambda nbytes: (limit, "a limit"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10**8))
    fake: Any = SimpleNamespace(metadata=SimpleNamespace(nbytes=4 * GIB), n_shards=0)
    mark = len(tables.emitted_since(0))
    bench.bench_shuffle(fake, bench.sizes_for(True, False), tmp_path / "out")
    (table,) = tables.emitted_since(mark)
    assert "Skipped: 0.10 GB free under" in table and "the shuffle needs 9.45 GB" in table
    assert removed == [True]


def test_paired_ratios_take_each_round_against_its_own_limit() -> None:
    # The disk halves its rate between rounds: each shuffle against the limits around it
    # gives 2.0, a median of shuffles over a median of limits would not.
    rounds = [{"shuffle": 4.0, "limit": 2.0}, {"shuffle": 8.0, "limit": 4.0}, {"shuffle": 9.0, "limit": 4.0}]
    assert bench.paired_ratios(rounds, "shuffle") == [2.0, 2.0, 2.25]
    assert bench.spread([2.0, 2.25, 1.5]) == "1.50-2.25" and bench.spread([]) == ""


def test_the_shuffle_table_pairs_every_shuffle_with_the_limits_around_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAEV_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(benchlib, "drop_cache", lambda path: None)
    # Round r: the disk scale[r] times slower for the limits around it and the shuffle alike,
    # the shuffle ratio[r] times its limit. Paired, the median ratio is 2.1; the median shuffle
    # over the median limit would say 8.8 / 4.0 = 2.2.
    scales, ratios = [1, 8, 2, 4, 16], [2.3, 2.0, 2.1, 2.2, 1.9]
    calls: list[str] = []

    def child(job: str, lim: Any, **kwargs: Any) -> dict[str, float]:
        calls.append(job)
        r = (len(calls) - 1) // 3  # each round: read, shuffle, read
        if job == "read":
            return {"read_s": 0.6 * scales[r], "write_s": 0.4 * scales[r]}
        return {"seconds": ratios[r] * scales[r], "scatter": 1.0 * scales[r], "merge": (ratios[r] - 1) * scales[r]}

    monkeypatch.setattr(bench, "in_child", child)

    class Limit:
        limit = GIB

        def __enter__(self) -> Limit:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def peak(self) -> int:
            return 0

    monkeypatch.setattr(bench, "limited", lambda nbytes: (Limit(), "a limit"))
    fake: Any = SimpleNamespace(metadata=SimpleNamespace(nbytes=GIB), n_shards=1, path=tmp_path,
                                shard_path=lambda k: tmp_path / "acts000000.bin")  # fmt: skip
    sizes = bench.sizes_for(False, False)
    mark = len(tables.emitted_since(0))
    bench.bench_shuffle(fake, sizes, tmp_path / "out")
    (table,) = tables.emitted_since(mark)
    assert sizes.shuffle_rounds == len(scales) and calls == ["read", "shuffle", "read"] * len(scales)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()
            if line.startswith("| ") and "---" not in line}  # fmt: skip
    shuffle = next(v for k, v in rows.items() if k.startswith("shuffle, all layers"))
    assert shuffle[0] == "8.80" and shuffle[1:3] == ["2.10", "1.90-2.30"]  # median seconds; paired ratios
    assert rows["its scatter pass (source read, runs written)"][1:3] == ["1.00", "1.00-1.00"]
    assert rows["its write pass (runs read, output written and published)"][1:3] == ["1.10", "0.90-1.30"]
    assert "the limit itself took 1.00-16.00 s" in table


# -- the cgroup helper ------------------------------------------------------------------------

HYBRID_MOUNTS = """\
35 25 0:30 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
36 25 0:31 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory
37 25 0:32 / /sys/fs/cgroup/cpu rw,relatime shared:12 - cgroup cgroup rw,cpu
40 1 8:1 / / rw,relatime - ext4 /dev/vda rw
"""
HYBRID_CGROUP = "4:memory:/process_api/abc\n1:cpu:/\n0::/\n"
V2_MOUNTS = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_mounts_and_memberships_are_parsed() -> None:
    mounts = cgroup._mounts(HYBRID_MOUNTS)
    assert [(p, kind) for _, p, kind, _ in mounts] == [
        ("/sys/fs/cgroup/unified", "cgroup2"),
        ("/sys/fs/cgroup/memory", "cgroup"),
        ("/sys/fs/cgroup/cpu", "cgroup"),
    ]
    assert "memory" in mounts[1][3]
    assert cgroup._memberships(HYBRID_CGROUP) == {"memory": "/process_api/abc", "cpu": "/", "v2": "/"}
    assert cgroup._under("/", "/sys/fs/cgroup/memory", "/process_api/abc") == Path(
        "/sys/fs/cgroup/memory/process_api/abc"
    )
    assert cgroup._under("/ns", "/sys/fs/cgroup", "/ns/job") == Path("/sys/fs/cgroup/job")  # a namespaced root


def test_locate_says_why_no_limit_can_be_set() -> None:
    with pytest.raises(cgroup.Unavailable, match="no cgroup v2 hierarchy mounted; no cgroup v1 memory hierarchy"):
        cgroup.locate("0::/\n", "40 1 8:1 / / rw - ext4 /dev/vda rw\n")
    with pytest.raises(cgroup.Unavailable, match="no memory controller"):
        cgroup.locate("0::/job\n", V2_MOUNTS.replace("/sys/fs/cgroup", "/nonexistent/cgroup"))


def _limit_or_skip(nbytes: int) -> cgroup.MemoryLimit:
    try:
        return cgroup.MemoryLimit.create(nbytes)
    except cgroup.Unavailable as e:
        pytest.skip(f"no cgroup memory limit here: {e}")


@pytest.mark.slow
def test_a_child_over_the_limit_is_killed_and_one_under_it_runs() -> None:
    with _limit_or_skip(256 << 20) as limit:
        pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        small = limit.run([sys.executable, "-c", "x = bytearray(32 << 20); print('ok')"], timeout=60, **pipes)
        assert small.returncode == 0 and small.stdout.strip() == "ok"
        grow = "x = bytearray(1 << 30); x[::4096] = b'1' * len(x[::4096]); print('ok')"
        big = limit.run([sys.executable, "-c", grow], timeout=60, **pipes)
        assert big.returncode != 0 and limit.oom_kills() >= 1
        assert (limit.peak() or 0) <= limit.limit
    assert not limit.path.exists()


@pytest.mark.slow
def test_the_page_cache_a_child_fills_is_held_to_the_limit(tmp_path: Path) -> None:
    with _limit_or_skip(64 << 20) as limit:
        script = (
            f"f = open({str(tmp_path / 'big.bin')!r}, 'wb'); [f.write(b'1' * (1 << 20)) for _ in range(256)]; f.close()"
        )
        done = limit.run([sys.executable, "-c", script], timeout=120)
        assert done.returncode == 0
        assert (limit.usage() or 0) <= limit.limit  # 256 MiB written, at most 64 MiB of it cached here
