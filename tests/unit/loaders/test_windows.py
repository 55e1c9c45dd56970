"""loaders.windows: cold reads of a layer selection (`WindowLoader.slice_reads`): a proper subset of the
layers is read slice by slice, each span's slices hinted to the storage first, so the disk
reads only the bytes a selection needs; the batches, their order and the loader's state are
exactly those of the whole-example reads it replaces."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards import loaders
from saev_shards.errors import FileSizeError
from saev_shards.loaders import plan, windows
from saev_shards.storage import local

from ...support.caches import small_metadata, write_cache
from ...support.loaders import check_batch

# 23 examples of 3 layers x (CLS + 4) tokens x 8 dims: 80-byte slices (float16), several
# windows and spans, batches that cross windows.
SIZES: dict[str, Any] = dict(batch_size=7, buffer_bytes=1200, block_bytes=480, read_threads=2)
WHOLE = 1 << 40  # MIN_HINTED_SLICE that no slice reaches: whole examples, the reads before


def three_layers(dtype: str = "float16") -> ss.Metadata:
    return small_metadata(layers=(2, 6, 11), dtype=dtype)


def run(shards: ss.Shards, epochs: int = 2, **kwargs: Any) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    """Every batch of ``epochs`` epochs as plain arrays, and the loader's state after them."""
    loader = loaders.TokenLoader(shards, **{**SIZES, **kwargs})
    out = []
    for _ in range(epochs):  # each iteration is the next epoch
        for b in loader:
            acts = b.acts.view(torch.int16) if b.acts.dtype == torch.bfloat16 else b.acts
            out.append((acts.numpy().copy(), b.examples.numpy().copy(), b.tokens.numpy().copy(), b.layers.numpy()))
    return out, loader.state_dict()


def same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
@pytest.mark.parametrize(
    ("layers", "extra"),
    [
        (6, {}),
        ([11, 2], {"mix_layers": True}),
        ([2, 6], {"stack_layers": True}),
        ([11, 2], {"stack_layers": True, "out_dtype": "float32"}),
    ],
)
@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_slice_reads_give_exactly_the_batches_of_whole_reads(
    root: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, layers: Any, extra: dict[str, Any], order: str
) -> None:
    md = three_layers(dtype)
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    chosen = dict(layers=layers, order=order, seed=3, **extra)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", WHOLE)
    whole, whole_state = run(shards, **chosen)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    sliced, sliced_state = run(shards, **chosen)
    same(sliced, whole)
    assert sliced_state == whole_state
    assert whole and len({b[1].tobytes() for b in whole}) > 1
    if dtype == "float16" and not extra.get("stack_layers"):
        for acts, ex, tok, lay in sliced:  # and they are the cache's values
            check_batch(loaders.Batch(torch.from_numpy(acts), torch.from_numpy(ex), torch.from_numpy(tok),
                                      torch.from_numpy(lay), None), md, logical)  # fmt: skip


def test_resume_midway_gives_the_rest_of_the_epoch(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state saved under whole reads resumes under slice reads with the same batches."""
    md = three_layers()
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", WHOLE)
    everything = [b.examples.numpy().copy() for b in loaders.TokenLoader(shards, layers=6, seed=1, **SIZES)]
    saver = loaders.TokenLoader(shards, layers=6, seed=1, **SIZES)
    running = iter(saver)
    first = [next(running).examples.numpy().copy() for _ in range(3)]
    saved = saver.state_dict()
    del running
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    resumed = loaders.TokenLoader(shards, layers=6, seed=1, **SIZES)
    resumed.load_state_dict(saved)
    rest = [b.examples.numpy() for b in resumed]
    same([(x,) for x in first + rest], [(x,) for x in everything])


def test_the_plain_slice_path_stays_correct(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices over `plan.MIN_SLICE_READ` (one row per chosen layer in the buffer) are hinted
    too, and the batches hold the cache's values."""
    md = three_layers()
    logical = write_cache(root, md)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(plan, "MIN_SLICE_READ", 0)
    hinted: list[tuple[int, int]] = []
    real = local.LocalFiles.prefetch

    def prefetch(self: Any, fd: int, start: int, stop: int, *, scattered: bool = False) -> None:
        hinted.append((start, stop))
        real(self, fd, start, stop, scattered=scattered)

    monkeypatch.setattr(local.LocalFiles, "prefetch", prefetch)
    seen = []
    for b in loaders.TokenLoader(shards, layers=[11, 6], mix_layers=True, **SIZES):
        seen += check_batch(b, md, logical)
    assert len(seen) == len(set(seen)) == md.n_examples * md.patches_per_ex * 2
    assert hinted


class Reads:
    """Bytes read from the cache's shard files with ``preadv``, and the ranges hinted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self.hints: list[tuple[str, int, int]] = []
        real_prefetch = local.LocalFiles.prefetch

        def preadv(fd: int, views: Any, offset: int, /) -> int:
            got = os.preadv(fd, views, offset)
            if re.fullmatch(r"acts\d+\.bin", Path(os.readlink(f"/proc/self/fd/{fd}")).name):
                self.bytes += got
            return got

        def prefetch(files: Any, fd: int, start: int, stop: int, *, scattered: bool = False) -> None:
            self.hints.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, start, stop))
            real_prefetch(files, fd, start, stop, scattered=scattered)

        monkeypatch.setattr(local.LocalFiles, "preadv", staticmethod(preadv))
        monkeypatch.setattr(local.LocalFiles, "prefetch", prefetch)


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc/self/fd to name descriptors")
@pytest.mark.parametrize(("layers", "positions"), [(6, [1]), ([2, 6], [0, 1]), ([11, 2], [2, 0])])
def test_a_selection_reads_only_its_slices_and_hints_them(
    root: Path, monkeypatch: pytest.MonkeyPatch, layers: Any, positions: list[int]
) -> None:
    """The disk is asked for the chosen slices and nothing else (whole examples read every
    layer, so one layer of two came at half the disk's rate at best), and every slice is
    hinted first, neighbours in one hint."""
    md = three_layers()
    write_cache(root, md)
    reads = Reads(monkeypatch)
    shards = ss.open(root / md.hash)  # opened after the spy: its handles bind preadv
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    slice_bytes = md.tokens_per_ex * md.d_model * 2
    for _ in loaders.TokenLoader(shards, layers=layers, mix_layers=True, **SIZES):
        pass
    assert reads.bytes == md.n_examples * len(positions) * slice_bytes
    runs = [(p, 1) for p in sorted(positions)]
    if sorted(positions) == [0, 1]:
        runs = [(0, 2)]
    eps = shards.examples_per_shard
    first = [
        (e, ((e % eps) * md.n_layers + p) * slice_bytes, n * slice_bytes) for e in range(md.n_examples) for p, n in runs
    ]
    expected = sorted((f"acts{e // eps:06d}.bin", start, start + size) for e, start, size in first)
    assert sorted(h for h in reads.hints if h[0].startswith("acts")) == expected
    # Before: whole examples, every layer read.
    reads.bytes = 0
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", WHOLE)
    for _ in loaders.TokenLoader(shards, layers=layers, mix_layers=True, **SIZES):
        pass
    assert reads.bytes == md.n_examples * md.n_layers * slice_bytes


def test_every_layer_is_read_whole(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All layers chosen: one read per span, no hints (the readahead streams it)."""
    md = three_layers()
    write_cache(root, md)
    reads = Reads(monkeypatch)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    for _ in loaders.TokenLoader(shards, mix_layers=True, **SIZES):
        pass
    assert reads.bytes == md.n_examples * md.n_layers * md.tokens_per_ex * md.d_model * 2
    assert not [h for h in reads.hints if h[0].startswith("acts")]


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
@pytest.mark.parametrize("d_model", [8, 24])
@pytest.mark.parametrize("laid_out", ["whole examples", "chosen layers"])
@pytest.mark.parametrize("layers", [11, [6, 2], [11, 2]])
def test_a_span_read_at_once_gives_the_batches_of_slice_by_slice_reads(
    root: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, d_model: int, laid_out: str, layers: Any
) -> None:
    """Each span's slices in one reader call (`Shards.read_slices_raw`, and `read_slices_scales`
    for float8_e4m3) give exactly the batches and state of reading them one by one, as the
    loader did before, whether the buffer lays whole examples out or the chosen layers only,
    for slices of 80 to 240 bytes (and 40 to 120 of float8_e4m3)."""
    md = small_metadata(layers=(2, 6, 11), d_model=d_model, dtype=dtype)
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    monkeypatch.setattr(plan, "MIN_SLICE_READ", 0 if laid_out == "chosen layers" else WHOLE)
    chosen = dict(layers=layers, seed=5, mix_layers=True, out_dtype="float32")
    calls: list[int] = []
    real = windows.WindowLoader._read_slice_by_slice

    def one_by_one(self: windows.WindowLoader, start: int, count: int, *args: Any) -> None:
        calls.append(count)
        real(self, start, count, *args)

    monkeypatch.setattr(windows.WindowLoader, "_read_slice_by_slice", one_by_one)
    at_once, at_once_state = run(shards, **chosen)
    assert not calls

    def never(*args: Any) -> None:
        raise FileSizeError("the span's reads gave up")

    monkeypatch.setattr(ss.Shards, "read_slices_raw", never)  # every span slice by slice
    sliced, sliced_state = run(shards, **chosen)
    assert calls
    same(at_once, sliced)
    assert at_once_state == sliced_state


def cut_short(path: Path, nbytes: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(nbytes)


@pytest.mark.parametrize("order", ["shuffled", "ordered"])
def test_a_shard_cut_short_after_open_is_the_error_of_its_first_slice(
    root: Path, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """Read into buffers slice by slice, a shard truncated after the cache was opened is the
    `FileSizeError` that `read_example_raw` gives for the first slice past its end."""
    md = three_layers()
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    eps = shards.examples_per_shard
    assert eps >= 2
    cut = (1 * md.n_layers + 1) * shards._slice_nbytes + 7  # inside shard 1's second example, layer 6
    cut_short(shards.shard_path(1), cut)
    with pytest.raises(FileSizeError) as expected:
        shards.read_example_raw(eps + 1, 1, np.empty((md.tokens_per_ex, md.d_model), np.float16))
    loader = loaders.TokenLoader(shards, layers=6, order=order, **{**SIZES, "read_threads": 1})
    with pytest.raises(FileSizeError) as err:
        list(loader)
    assert str(err.value) == str(expected.value)


def test_a_bad_scale_before_a_cut_in_one_span_is_still_the_first_error(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float8_e4m3 span whose example 7 has a scale the rule cannot give and whose shard ends
    inside example 8: the `ScaleError` of example 7, as slice-by-slice reads met it first (the
    span's values are read before its scales, so the span's own reads hit the cut first)."""
    md = small_metadata(dtype="float8_e4m3")  # 23 examples (5 per shard), layers (6, 11), 5 x 8
    x = np.random.default_rng(0).standard_normal(md.shape).astype(np.float32)
    with ss.ShardWriter(root, md, durable=False) as w:
        w.write(x)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    scale_file = root / md.hash / "scales000001.bin"
    os.chmod(scale_file, 0o644)
    vector = (2 * 2 + 1) * 5 + 2  # example 7 (shard 1's third), position 1, token 2
    with open(scale_file, "r+b") as f:
        f.seek(4 * vector)
        f.write(np.array([np.inf], np.float32).tobytes())
    cut_short(shards.shard_path(1), (3 * 2 + 1) * shards._slice_nbytes + 3)  # inside example 8's layer 11
    loader = loaders.OrderedLoader(
        shards, batch_size=4, layers=11, block_bytes=400, buffer_bytes=4000, read_threads=1
    )  # fmt: skip
    assert loader.read_threads == 1
    with pytest.raises(
        ss.ScaleError, match=r"scales000001\.bin: vector 27 \(example 7, layer 11, token 2\): scale inf"
    ):
        list(loader)


def test_a_cache_removed_before_its_first_read_is_named(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = three_layers()
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    monkeypatch.setattr(windows, "MIN_HINTED_SLICE", 0)
    loader = loaders.TokenLoader(shards, layers=[11, 2], mix_layers=True, **SIZES)
    for entry in (root / md.hash).iterdir():
        os.chmod(entry, 0o644)
    shutil.rmtree(root / md.hash)
    with pytest.raises(ss.CacheNotFoundError, match="the cache was removed while open"):
        list(loader)
