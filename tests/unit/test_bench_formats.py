"""The benchmark's format adapters return exactly the data they were given (a benchmark of wrong data is void),
and its harness puts a store in the page-cache state it is timed in."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("zarr")
pytest.importorskip("h5py")
pytest.importorskip("safetensors")

from benchmarks.peers import adapters as F
from benchmarks.peers.data import CacheSpec, Source, files, remove

# 3 shards, the last one short: 7 examples x 3 layers x 5 tokens x 16 dims.
SPEC = CacheSpec(n_examples=7, n_layers=3, tokens=5, d_model=16, examples_per_shard=3)


@pytest.fixture(scope="module")
def source() -> Source:
    return Source(SPEC, seed=1, extra_nbytes=4096)


def test_source_is_deterministic_and_examples_differ(source: Source) -> None:
    again = Source(SPEC, seed=1, extra_nbytes=4096)
    logical = np.concatenate([b for _, b in source.batches()])
    assert logical.shape == SPEC.shape and logical.dtype == np.float16
    np.testing.assert_array_equal(logical, np.concatenate([b for _, b in again.batches()]))
    flat = logical.reshape(SPEC.n_examples, -1)
    assert len({row.tobytes() for row in flat}) == SPEC.n_examples
    np.testing.assert_array_equal(source.example(4), logical[4])


@pytest.mark.parametrize("key", sorted(F.FORMATS))
def test_adapter_round_trips(key: str, source: Source, tmp_path: Path) -> None:
    fmt = F.FORMATS[key]
    logical = np.concatenate([b for _, b in source.batches()])
    root = tmp_path / key
    root.mkdir()
    path = fmt.write(root, SPEC, source, False)
    assert files(path)
    reader = fmt.open(path, SPEC)
    try:
        out = np.empty((SPEC.tokens, SPEC.d_model), np.float16)
        for e in range(SPEC.n_examples):
            for layer in range(SPEC.n_layers):
                np.testing.assert_array_equal(reader.read(e, layer, out), logical[e, layer])
        ex = np.array([6, 0, 3, 3])
        layers = np.array([[2, 0], [1, 2], [0, 1], [2, 1]])
        pairs = reader.read_pairs(ex, layers, np.empty((4, 2, SPEC.tokens, SPEC.d_model), np.float16))
        np.testing.assert_array_equal(pairs, logical[ex[:, None], layers])
        rng = np.random.default_rng(0)
        gex, glayer, gtok = (rng.integers(0, n, 50) for n in SPEC.shape[:3])
        got = reader.gather(gex, glayer, gtok, np.empty((50, SPEC.d_model), np.float16))
        np.testing.assert_array_equal(got, logical[gex, glayer, gtok])
    finally:
        reader.close()
    remove(path)
    assert not path.exists()


def test_a_store_is_read_whole_before_its_first_page_cached_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The page cache's folios are set by the first read of a page: a store read at random by
    # a cold workload, or just written, is evicted and read whole before it is timed page-cached.
    from benchmarks import benchlib
    from benchmarks.peers.harness import QUICK, Harness

    monkeypatch.setenv("SAEV_BENCH_DIR", str(tmp_path / "bench"))
    calls: list[str] = []
    monkeypatch.setattr(benchlib, "drop_cache", lambda paths: calls.append("drop"))
    monkeypatch.setattr(benchlib, "warm_cache", lambda paths: calls.append("warm"))
    h = Harness(QUICK)
    store = tmp_path / "store"
    store.mkdir()
    (store / "a.bin").write_bytes(b"x" * 4096)

    def prepared(regime: str) -> list[str]:
        calls.clear()
        h.prepare(store, regime)
        return list(calls)

    assert prepared("page-cached") == ["drop", "warm"]  # just written: read whole
    assert prepared("page-cached") == ["warm"]  # settled: only made sure it is all there
    assert prepared("cold") == ["drop"]
    assert prepared("page-cached") == ["drop", "warm"]  # read at random since: again
    assert prepared("page-cached") == ["warm"]
    (store / "a.bin").unlink()
    (store / "a.bin").write_bytes(b"y" * 8192)  # written again at the same path
    assert prepared("page-cached") == ["drop", "warm"]
