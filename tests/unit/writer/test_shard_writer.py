"""ShardWriter: clear errors, nothing half-published, resumable, several writers, same bytes."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import fileio
from saev_shards.codecs.bfloat16 import float32_to_bf16
from saev_shards.protocol.staging import lock_path, staging_dir
from saev_shards.writer import direct as direct_module

from ...support.caches import float_input, labels_for, logical_tensor, small_metadata, tree_bytes, write_cache


def test_publishes_read_only(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md, labels=True)
    path = root / md.hash
    assert not staging_dir(root, md).exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o555
    for f in path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o444
    assert sorted(p.name for p in path.iterdir()) == [
        "acts000000.bin", "acts000001.bin", "acts000002.bin", "acts000003.bin", "acts000004.bin",
        "blocks.json", "labels.bin", "metadata.json", "shards.json",
    ]  # fmt: skip


def test_already_published_is_an_error(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md)
    before = tree_bytes(root / md.hash)
    with pytest.raises(ss.AlreadyPublishedError, match="already published"):
        ss.ShardWriter(root, md)
    assert isinstance(ss.AlreadyPublishedError("x"), FileExistsError)
    # The refused second write touched nothing: the published cache is as it was, no staging.
    assert tree_bytes(root / md.hash) == before
    assert not staging_dir(root, md).exists()
    assert sorted(p.name for p in root.iterdir()) == [md.hash]


@pytest.mark.parametrize(
    ("shape", "message"),
    [((2, 2, 5), r"expected shape \(B, 2, 5, 8\)"), ((2, 3, 5, 8), r"found \(2, 3, 5, 8\)"), ((2, 2, 5, 9), "d_model")],
)
def test_wrong_shapes(root: Path, shape: tuple[int, ...], message: str) -> None:
    w = ss.ShardWriter(root, small_metadata(), durable=False)
    with pytest.raises(ss.WriterError, match=message):
        w.write(np.zeros(shape, np.float16))
    w.abort()


def test_integer_input_is_rejected(root: Path) -> None:
    w = ss.ShardWriter(root, small_metadata(), durable=False)
    with pytest.raises(ss.WriterError, match="expected floating-point activations, found dtype int64"):
        w.write(np.zeros((1, 2, 5, 8), np.int64))
    w.abort()


def test_too_many_examples(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((20, 2, 5, 8), np.float16))
    with pytest.raises(ss.WriterError, match=r"too many examples: 20 written \+ 4 in this batch > 23 expected"):
        w.write(np.zeros((4, 2, 5, 8), np.float16))
    w.write(np.zeros((3, 2, 5, 8), np.float16))  # the failed batch was not counted
    assert w.close() == root / md.hash


def test_closing_short_publishes_nothing(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(np.zeros((10, 2, 5, 8), np.float16))
    with pytest.raises(ss.WriterError, match=r"missing examples \(acts: 10 of 23 examples\); nothing was published"):
        w.close()
    assert not (root / md.hash).exists()


def test_missing_labels_publish_nothing(root: Path) -> None:
    md = small_metadata()
    acts = np.zeros(md.shape, np.float16)
    with pytest.raises(ss.WriterError, match="labels: 5 of 23"), ss.ShardWriter(root, md, durable=False) as w:
        w.write(acts)
        w.write_labels(labels_for(md)[:5])
    assert not (root / md.hash).exists()


def test_exception_inside_with_publishes_nothing(root: Path) -> None:
    md = small_metadata()
    with pytest.raises(RuntimeError, match="boom"), ss.ShardWriter(root, md, durable=False) as w:
        w.write(np.zeros(md.shape, np.float16))
        raise RuntimeError("boom")
    assert not (root / md.hash).exists()


def test_nonfinite_raises_with_count_and_examples(root: Path) -> None:
    md = small_metadata()
    acts = np.ones(md.shape, np.float32)
    acts[3, 0, 0, 0] = 70000.0  # above float16's 65504
    acts[12, 1, 2, 3] = -1e9
    acts[12, 1, 2, 4] = np.inf
    w = ss.ShardWriter(root, md, durable=False)
    w.write(acts[:2])
    with pytest.raises(ss.NonFiniteError) as info:
        w.write(acts[2:23])
    message = str(info.value)
    assert "3 values in 2 examples (global indices 3, 12)" in message
    assert "float16 holds at most 65504, the largest |value| was inf" in message
    assert "allow_nonfinite=True" in message
    w.abort()


def test_nonfinite_from_torch_bf16(root: Path) -> None:
    md = small_metadata(dtype="bfloat16")
    acts = torch.ones(md.shape)
    acts[5, 0, 0, 0] = float("nan")
    w = ss.ShardWriter(root, md, durable=False)
    with pytest.raises(ss.NonFiniteError, match=r"1 values in 1 examples \(global indices 5\)"):
        w.write(acts)
    w.abort()


def test_allow_nonfinite_stores_inf(root: Path) -> None:
    md = small_metadata(n_examples=1)
    acts = np.zeros(md.shape, np.float32)
    acts[0, 0, 0, 0] = 1e5
    with ss.ShardWriter(root, md, allow_nonfinite=True, durable=False) as w:
        w.write(acts)
    assert ss.open(root / md.hash).get(0, 6, 0)[0] == np.inf


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_and_numpy_inputs_give_identical_bytes(tmp_path: Path, dtype: str) -> None:
    md = small_metadata(dtype=dtype)
    rng = np.random.default_rng(5)
    values = (rng.standard_normal(md.shape) * 100).astype(np.float32)
    values.flat[:6] = [0.0, -0.0, 65504.0, 1e-8, 3.0e38, -3.0e38]
    allow = dtype != "float32"
    for name, source in (("numpy", values), ("torch", torch.from_numpy(values)), ("f64", values.astype(np.float64))):
        with ss.ShardWriter(tmp_path / name, md, allow_nonfinite=allow, durable=False) as w:
            w.write(source)
    assert tree_bytes(tmp_path / "numpy" / md.hash) == tree_bytes(tmp_path / "torch" / md.hash)
    if dtype != "bfloat16":  # float64 -> bfloat16 rounds once in torch, twice via float32 in numpy
        assert tree_bytes(tmp_path / "numpy" / md.hash) == tree_bytes(tmp_path / "f64" / md.hash)


def test_bf16_rounding_matches_torch() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(10_000).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, 1.00390625, 1.01171875], np.float32),
            rng.integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ]
    )
    ours = float32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(ss.bf16_to_float32(ours[nan])).all()


def test_buffers_may_be_reused_after_write(root: Path) -> None:
    """With background writes, the caller may overwrite its batch buffer right after write()."""
    md = small_metadata()
    logical = logical_tensor(md)
    buf = np.empty((1, *md.shape[1:]), np.float16)
    with ss.ShardWriter(root, md, background=True, durable=False) as w:
        for i in range(md.n_examples):
            buf[:] = logical[i]
            w.write(buf)
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


def test_columns_dtype_and_shape_checks(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write_columns(token_ids=np.zeros((2, 5), np.int32))
    with pytest.raises(ss.WriterError, match=r"column.token_ids: expected shape \(B, 5\) dtype int32"):
        w.write_columns(token_ids=np.zeros((2, 4), np.int32))
    w.write_columns(token_ids=np.ones((1, 5), np.int64))  # values fit: cast to the column's dtype
    with pytest.raises(ss.WriterError, match=r"lengths: values must lie in \[0, 5\]"):
        w.write_columns(lengths=np.array([6]))
    with pytest.raises(ss.WriterError, match="bad column/text name 'Bad-Name'"):
        w.write_columns(**{"Bad-Name": np.zeros(1)})
    with pytest.raises(ss.WriterError, match="found a string"):
        w.write_text(prompt="not a list")
    w.abort()


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ("lengths", "columns: expected a mapping of column name -> (dtype, shape) such as {'lengths': ('int32', ())"),
        (
            {"lengths": "int32"},
            "columns['lengths']: expected (dtype, shape) such as ('int32', ()) or ('int32', (64,)), found 'int32'",
        ),
        ({"lengths": np.int32}, "columns['lengths']: expected (dtype, shape)"),
        ({"lengths": ("int32", (), 0)}, "columns['lengths']: expected (dtype, shape)"),
        ({"lengths": ("int33", ())}, "columns['lengths'] dtype: expected a numpy dtype of ['|b1', "),
        (
            {"ids": ("int32", 64)},
            "columns['ids'] shape: expected a tuple of sizes, () for one value per example, found 64",
        ),
        ({"ids": ("int32", (-1,))}, "columns['ids'] shape: expected sizes >= 0, found (-1,)"),
        ({"ids": ("complex64", ())}, "column.ids: dtype complex64 is not allowed"),
    ],
)
def test_columns_declaration_is_checked_with_a_clear_error(root: Path, columns: Any, message: str) -> None:
    """docs/dump.md's ``ShardWriter(..., columns=...)``: a wrong value once gave 'too many values to unpack'."""
    with pytest.raises(ss.WriterError) as info:
        ss.ShardWriter(root, small_metadata(), columns=columns, durable=False)
    assert message in str(info.value)
    assert not (root / small_metadata().hash).exists()


def test_columns_declared_as_documented(root: Path) -> None:
    md = small_metadata(n_examples=2)
    columns = {"lengths": ("int32", ()), "token_ids": (np.int32, [md.tokens_per_ex])}
    with ss.ShardWriter(root, md, columns=columns, durable=False) as w:
        w.write(np.zeros(md.shape, np.float16), columns={"lengths": [5, 3], "token_ids": np.ones((2, 5), np.int32)})
    shards = ss.open(root / md.hash)
    assert shards.columns["token_ids"].shape == (2, 5) and shards.columns["lengths"].tolist() == [5, 3]


def test_legacy_protocol_refuses_columns(root: Path) -> None:
    md = small_metadata(dtype="float32", protocol="2.1", data="x")
    with pytest.raises(ss.WriterError, match=r"protocol 2\.1 caches .* hold activations and labels only"):
        ss.ShardWriter(root, md, stats=True)


def test_empty_cache(root: Path) -> None:
    md = small_metadata(n_examples=0)
    with ss.ShardWriter(root, md) as w:
        pass
    shards = ss.open(w.path)
    assert shards.shape == (0, 2, 5, 8)
    assert shards[:].shape == (0, 2, 5, 8)
    assert shards.manifest.shards == ()


def test_several_writers_equal_one(tmp_path: Path) -> None:
    """3 ranks writing disjoint shard blocks, then finalize: byte-identical to a single writer."""
    md = small_metadata()
    lengths = (np.arange(md.n_examples) % 5 + 1).astype(np.int16)
    single = write_cache(tmp_path / "one", md, labels=True, lengths=lengths, text=True, stats=True)
    source = float_input(md, single)
    labels = labels_for(md)
    root = tmp_path / "three"
    writers = [ss.ShardWriter(root, md, rank=r, world_size=3, stats=True, durable=False) for r in range(3)]
    assert [(w.start, w.stop) for w in writers] == [(0, 5), (5, 15), (15, 23)]
    with pytest.raises(ss.WriterBusyError, match="writers are still running"):
        ss.finalize(root, md)
    for w in reversed(writers):  # order does not matter
        for a in range(w.start, w.stop, 3):
            b = min(a + 3, w.stop)
            w.write(
                source[a:b],
                labels=labels[a:b],
                columns={"lengths": lengths[a:b]},
                text={"prompt": [f"example {i}: é" for i in range(a, b)]},
            )
        assert w.close() is None
    assert not (root / md.hash).exists()
    assert ss.finalize(root, md) == root / md.hash
    assert tree_bytes(root / md.hash) == tree_bytes(tmp_path / "one" / md.hash)


def test_finalize_reports_missing_shards(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, rank=0, world_size=2, durable=False)
    w.write(np.zeros((w.stop - w.start, 2, 5, 8), np.float16))
    w.close()
    with pytest.raises(ss.WriterError, match=r"3 shards incomplete:\n  shard 2: not written \(no part000002.json\)"):
        ss.finalize(root, md)


def test_same_rank_twice_is_busy(root: Path) -> None:
    md = small_metadata()
    a = ss.ShardWriter(root, md, durable=False)
    with pytest.raises(ss.WriterBusyError, match="locked by another writer"):
        ss.ShardWriter(root, md, durable=False)
    a.abort()


def test_rank_from_environment(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    md = small_metadata()
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "6")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    w = ss.ShardWriter(root, md, durable=False)
    assert (w.rank, w.world_size) == (1, 2)
    w.abort()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    w = ss.ShardWriter(root, md, durable=False)
    assert (w.rank, w.world_size, w.start, w.stop) == (0, 3, 0, 5)
    w.abort()
    with pytest.raises(ss.WriterError, match="give both rank and world_size"):
        ss.ShardWriter(root, md, rank=1)


def test_resume_after_abort_is_byte_identical(tmp_path: Path) -> None:
    md = small_metadata()
    expected_root = tmp_path / "clean"
    logical = write_cache(expected_root, md, labels=True, stats=True)
    source, labels = float_input(md, logical), labels_for(md)
    root = tmp_path / "resumed"
    w = ss.ShardWriter(root, md, labels=True, stats=True, durable=False)
    w.write(source[:13], labels=labels[:13])  # shards 0 and 1 complete, shard 2 partial
    w.abort()
    w = ss.ShardWriter(root, md, labels=True, stats=True, resume=True, durable=False)
    assert w.next_example == 10
    w.write(source[10:], labels=labels[10:])
    w.close()
    assert tree_bytes(root / md.hash) == tree_bytes(expected_root / md.hash)


def test_resume_rewrites_a_corrupted_shard(tmp_path: Path) -> None:
    """Resuming keeps the shards whose bytes match their records, rewrites the first one that
    does not and everything after it, and publishes exactly the cache of an uninterrupted run."""
    md = small_metadata()
    logical = logical_tensor(md)
    clean = tmp_path / "clean"
    write_cache(clean, md)
    root = tmp_path / "resumed"
    w = ss.ShardWriter(root, md, durable=False)
    w.write(logical[:15])  # shards 0, 1 and 2 complete
    w.abort()
    staging = staging_dir(root, md)
    kept = (staging / "acts000000.bin").stat().st_ino
    shard1 = staging / "acts000001.bin"
    data = bytearray(shard1.read_bytes())
    data[7] ^= 0xFF
    shard1.write_bytes(bytes(data))
    w = ss.ShardWriter(root, md, resume=True, durable=False)
    assert w.next_example == 5  # shard 1's checksum no longer matches its record: resume from it
    w.write(logical[5:])
    w.close()
    published = root / md.hash
    assert (published / "acts000000.bin").stat().st_ino == kept  # the intact shard was not rewritten
    assert tree_bytes(published) == tree_bytes(clean / md.hash)  # the corrupted byte is gone
    shards = ss.open(published)
    shards.verify()
    np.testing.assert_array_equal(shards[:], logical)


def test_fresh_start_discards_stale_staging(root: Path) -> None:
    md = small_metadata()
    logical = logical_tensor(md)
    w = ss.ShardWriter(root, md, durable=False)
    w.write(logical[:15])
    w.abort()
    w = ss.ShardWriter(root, md, durable=False)
    assert w.next_example == 0
    w.write(logical)
    w.close()
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, numpy as np
    sys.path.insert(0, {repo!r})
    import saev_shards as ss
    from tests.support.caches import small_metadata, logical_tensor
    md = small_metadata(n_examples=4000, d_model=64, patches_per_shard=1000)
    logical = logical_tensor(md)
    w = ss.ShardWriter({root!r}, md, resume={resume})
    print(w.next_example, flush=True)
    for a in range(w.next_example, md.n_examples, 50):
        w.write(logical[a:a + 50])
        if {pause}:
            import time; time.sleep(0.01)
    w.close()
    print("done", flush=True)
    """
)


def run_writer(root: Path, resume: bool, pause: bool) -> subprocess.Popen[str]:
    repo = str(Path(__file__).resolve().parents[3])
    code = KILL_SCRIPT.format(repo=repo, root=str(root), resume=resume, pause=pause)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_sigkill_publishes_nothing_and_resume_is_byte_identical(tmp_path: Path) -> None:
    md = small_metadata(n_examples=4000, d_model=64, patches_per_shard=1000)
    root = tmp_path / "killed"
    proc = run_writer(root, resume=False, pause=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "0"
    staging = staging_dir(root, md)
    deadline = time.monotonic() + 60
    while not any(staging.glob("part*.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (root / md.hash).exists()
    with pytest.raises(ss.CacheNotFoundError):
        ss.open(root / md.hash)
    sealed = len(list(staging.glob("part*.json")))
    assert sealed >= 1
    proc = run_writer(root, resume=True, pause=False)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    first, last = out.split()
    assert int(first) >= sealed * md.examples_per_shard > 0
    assert last == "done"
    clean = tmp_path / "clean"
    write_cache(clean, md, batches=[50], durable=True)
    assert tree_bytes(root / md.hash) == tree_bytes(clean / md.hash)


def test_writer_repr_and_durable_default(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md)
    assert w.durable
    assert "rank=0/1, examples [0, 23), next=0" in repr(w)
    w.abort()
    assert os.path.isdir(staging_dir(root, md))


def test_stats_need_lengths_with_the_activations(root: Path) -> None:
    md = small_metadata()
    acts = np.zeros((2, *md.shape[1:]), np.float16)
    w = ss.ShardWriter(root, md, stats=True, durable=False)
    with pytest.raises(ss.WriterError, match="lengths must come with their activations"):
        w.write_columns(lengths=np.array([1, 2]))
    w.write(acts, columns={"lengths": np.array([1, 2])})
    with pytest.raises(ss.WriterError, match="pass lengths with every batch of activations or with none"):
        w.write(acts)
    w.abort()


@given(chunks=st.lists(st.integers(0, 20_000), max_size=12), direct=st.booleans())
@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the block size is constant
def test_sequential_file_writes_exact_bytes(monkeypatch_block: None, chunks: list[int], direct: bool) -> None:
    """O_DIRECT blocks, short remainders and the buffered tail add up to exactly the bytes given."""
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[2]) as tmp:
        path = Path(tmp) / "f.bin"
        rng = np.random.default_rng(len(chunks))
        data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in chunks]
        f = direct_module.SequentialFile(path, direct=direct)
        for d in data:
            f.write(memoryview(d))
        f.close(durable=False)
        assert path.read_bytes() == b"".join(data)


@pytest.fixture
def monkeypatch_block() -> Iterator[None]:
    saved = direct_module.DIRECT_BLOCK
    direct_module.DIRECT_BLOCK = 8192  # two alignment units, so every path is hit with small data
    yield
    direct_module.DIRECT_BLOCK = saved


def test_large_shards_go_through_o_direct(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20 MB shard (one 16 MiB block, an aligned rest, an unaligned tail) and a 10 MB one."""
    md = small_metadata(d_model=1000, n_examples=1500, patches_per_shard=10_000)
    assert md.shard_nbytes(0) == 20_000_000 > direct_module.DIRECT_BLOCK
    opened_direct = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            opened_direct.append(Path(path).name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    logical = write_cache(root, md, batches=[7, 300])
    assert opened_direct == ["acts000000.bin"]
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


def test_falls_back_when_o_direct_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = small_metadata(d_model=1000, n_examples=1000, patches_per_shard=10_000)
    real_open = os.open

    def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported here")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    logical = write_cache(root, md, batches=[64])
    np.testing.assert_array_equal(ss.open(root / md.hash)[:], logical)


class _Stop(Exception):
    """Raised by a test hook to stop a writer at a named point (a crash without the kill)."""


def _stop_at(monkeypatch: pytest.MonkeyPatch, point: str, then: Any = None) -> None:
    def hook(name: str, index: int) -> None:
        if name == point:
            if then is not None:
                then()
            raise _Stop(point)

    monkeypatch.setattr(fileio, "fault_hook", hook)


def test_publish_rechecks_what_it_renames(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stray file, or a missing shard, in staging at the last moment: nothing is published,
    and every difference is named."""
    md = small_metadata()
    staging = staging_dir(root, md)

    def tamper() -> None:
        (staging / "notes.txt").write_text("stray")
        (staging / "acts000002.bin").unlink()

    hooked = False

    def hook(name: str, index: int) -> None:
        nonlocal hooked
        if name == "staging-cleaned" and not hooked:
            hooked = True
            tamper()

    monkeypatch.setattr(fileio, "fault_hook", hook)
    with pytest.raises(ss.WriterError, match="refusing to publish") as info:
        write_cache(root, md)
    assert f"{staging / 'acts000002.bin'}: missing" in str(info.value)
    assert f"{staging / 'notes.txt'}: not expected here" in str(info.value)
    assert not (root / md.hash).exists()
    monkeypatch.setattr(fileio, "fault_hook", None)
    (staging / "notes.txt").unlink()
    with pytest.raises(ss.WriterError, match=r"acts000002\.bin: missing"):
        ss.finalize(root, md)  # the manifest lists it: refused again, never published without it
    assert not (root / md.hash).exists()


def test_resume_of_a_finalized_staging_with_other_streams_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finalize stopped after freezing the files (shards.json written, part records gone);
    a resumed writer that declares other streams (no labels) restarts cleanly."""
    md = small_metadata()
    root = tmp_path / "root"
    _stop_at(monkeypatch, "publish-frozen")
    with pytest.raises(_Stop):
        write_cache(root, md, labels=True)
    monkeypatch.setattr(fileio, "fault_hook", None)
    staging = staging_dir(root, md)
    assert (staging / "shards.json").exists() and not list(staging.glob("part*"))
    w = ss.ShardWriter(root, md, resume=True, durable=False)
    assert w.next_example == 0  # the finalized cache had labels: nothing reusable
    w.write(logical_tensor(md))
    w.close()
    write_cache(tmp_path / "clean", md)
    assert tree_bytes(root / md.hash) == tree_bytes(tmp_path / "clean" / md.hash)
    assert sorted(os.listdir(root)) == [md.hash]


@pytest.mark.parametrize("protocol", ["3.0", "2.1"])
def test_resume_of_a_finalized_staging_publishes_it_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    """Also for 2.1, whose shards.json has no sizes (checksums.json, written before it, has)."""
    legacy = protocol == "2.1"
    md = small_metadata(protocol=protocol, dtype="float32", data="x") if legacy else small_metadata()
    root = tmp_path / "root"
    _stop_at(monkeypatch, "staging-cleaned")
    with pytest.raises(_Stop):
        write_cache(root, md, labels=True, stats=not legacy)
    monkeypatch.setattr(fileio, "fault_hook", None)
    w = ss.ShardWriter(root, md, resume=True, labels=True, stats=not legacy, durable=False)
    assert w.next_example == md.n_examples
    assert w.close() == root / md.hash
    write_cache(tmp_path / "clean", md, labels=True, stats=not legacy)
    assert tree_bytes(root / md.hash) == tree_bytes(tmp_path / "clean" / md.hash)


def test_same_rank_twice_is_busy_before_touching_the_first_ones_files(root: Path) -> None:
    md = small_metadata()
    first = ss.ShardWriter(root, md, rank=1, world_size=2, durable=False, background=False)
    first.write(logical_tensor(md)[first.start : first.start + 5])  # shard 2 sealed
    staging = staging_dir(root, md)
    sealed = sorted(p.name for p in staging.iterdir())
    with pytest.raises(ss.WriterBusyError, match=r"shards \[2, 5\) are being written by another process"):
        ss.ShardWriter(root, md, rank=1, world_size=2, durable=False)
    assert sorted(p.name for p in staging.iterdir()) == sealed
    first.abort()


def test_lock_file_sits_beside_staging_and_goes_with_publishing(root: Path) -> None:
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    assert lock_path(root, md).exists() and lock_path(root, md).parent == root
    assert not (staging_dir(root, md) / ".lock").exists()
    assert ss.store.list_unpublished(root) == [staging_dir(root, md)]  # the lock file is not listed
    w.write(logical_tensor(md))
    w.close()
    assert sorted(os.listdir(root)) == [md.hash]
