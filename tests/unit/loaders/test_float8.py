"""Loaders over a float8_e4m3 cache: one byte per value read from disk (and moved to the device),
dequantized once per batch, the host and device paths giving the same batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards.codecs import float8
from saev_shards.loaders import ExampleDataset, LayerPairDataset, OrderedLoader, ShuffledLoader, TokenDataset, device

from ...support.caches import small_metadata, write_cache
from ...support.loaders import check_batch
from .test_device import assert_same_batches


@pytest.fixture
def cache8(root: Path) -> tuple[ss.Shards, np.ndarray[Any, Any]]:
    md = small_metadata(dtype="float8_e4m3", n_examples=23)
    lengths = np.arange(md.n_examples) % (md.tokens_per_ex + 1)
    logical = write_cache(root, md, labels=True, lengths=lengths)
    return ss.open(root / md.hash), logical


def test_batches_are_the_dequantized_values(cache8: tuple[ss.Shards, Any]) -> None:
    shards, logical = cache8
    md = shards.metadata
    for cls in (ShuffledLoader, OrderedLoader):
        batches = list(cls(shards, batch_size=7, buffer_bytes=300, block_bytes=64, mix_layers=True))
        assert batches and all(b.acts.dtype == torch.float16 for b in batches)  # the default for float8
        seen = [key for b in batches for key in check_batch(b, md, logical)]
        assert len(seen) == len(set(seen))
    wide = next(iter(ShuffledLoader(shards, batch_size=50, out_dtype="float32", mix_layers=True)))
    assert wide.acts.dtype == torch.float32
    positions = [md.layers.index(int(v)) for v in wide.layers]
    np.testing.assert_array_equal(wide.acts.numpy(), logical[wide.examples.numpy(), positions, wide.tokens.numpy()])


@pytest.mark.parametrize("stack_layers", [False, True])
@pytest.mark.parametrize("out_dtype", [None, "float32", "bfloat16"])
def test_host_and_device_batches_are_equal(cache8: tuple[ss.Shards, Any], stack_layers: bool, out_dtype: Any) -> None:
    shards, _ = cache8
    kwargs: dict[str, Any] = dict(
        batch_size=9, seed=2, buffer_bytes=500, block_bytes=100, stack_layers=stack_layers, out_dtype=out_dtype,
        mix_layers=not stack_layers,
    )  # fmt: skip
    host = list(ShuffledLoader(shards, **kwargs))
    dev = list(ShuffledLoader(shards, device="cpu", **kwargs))
    assert_same_batches(host, dev)
    assert host[0].acts.shape[1:] == ((2, 8) if stack_layers else (8,))


def test_one_byte_per_value_is_read_and_moved(cache8: tuple[ss.Shards, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An epoch reads each example's stored bytes and scales once: md.nbytes + md.scales_nbytes,
    half a float16 cache's bytes and then 4 bytes per vector; the device path's slots hold bytes."""
    shards, _ = cache8
    md = shards.metadata
    read: list[int] = []
    for name in ("read_range_raw", "read_range_scales"):
        real = getattr(shards, name)

        def counting(start: int, stop: int, out: Any = None, _real: Any = real) -> Any:
            result = _real(start, stop, out)
            read.append(result.nbytes)
            return result

        monkeypatch.setattr(shards, name, counting)
    list(ShuffledLoader(shards, batch_size=8, tokens="all", skip_padding=False, mix_layers=True))
    assert (
        sum(read) == md.nbytes + md.scales_nbytes == md.n_examples * md.n_layers * md.tokens_per_ex * (md.d_model + 4)
    )
    made: list[device.Slots] = []
    real_slots = device.Slots

    def keeping(*args: Any) -> device.Slots:
        made.append(real_slots(*args))
        return made[-1]

    from saev_shards.loaders import spares

    monkeypatch.setattr(spares, "Slots", keeping)
    list(ShuffledLoader(shards, batch_size=8, device="cpu", mix_layers=True))
    [slots] = made
    assert slots.acts[0].dtype == torch.uint8 and slots.windows[0].dtype == torch.uint8
    assert slots.scales[0].dtype == torch.float32 and len(slots.scales[0]) == len(slots.acts[0])


def test_float16_overflow_is_an_error_on_both_paths(root: Path) -> None:
    md = small_metadata(dtype="float8_e4m3", n_examples=5)
    x = np.ones(md.shape, np.float32)
    x[3, 0, 2, 5] = 1e6
    with ss.ShardWriter(root, md, durable=False) as w:
        w.write(x)
    shards = ss.open(root / md.hash)
    for dev in (None, "cpu"):
        with pytest.raises(ss.DtypeRangeError, match="do not fit float16"):
            list(ShuffledLoader(shards, batch_size=4, layers=6, tokens="all", device=dev))
        wide = list(ShuffledLoader(shards, batch_size=4, layers=6, tokens="all", device=dev, out_dtype="float32"))
        assert max(float(b.acts.max()) for b in wide) == pytest.approx(1e6, rel=1 / 16)
        # Batches without the vector are fine in float16 (layer 11 holds no large value).
        assert all(torch.isfinite(b.acts).all() for b in ShuffledLoader(shards, batch_size=4, layers=11, device=dev))


def test_datasets_dequantize(cache8: tuple[ss.Shards, Any]) -> None:
    shards, logical = cache8
    md = shards.metadata
    item = TokenDataset(shards, layer=11, tokens="all")[7]
    assert item["acts"].dtype == torch.float16
    np.testing.assert_array_equal(item["acts"].numpy(), logical[item["example"], 1, item["token"]])
    ex = ExampleDataset(shards, layers=6, out_dtype="float32")[4]
    np.testing.assert_array_equal(ex["acts"].numpy(), logical[4, 0].astype(np.float32))
    pair = LayerPairDataset(shards, out_dtype="bfloat16")[2]
    assert pair["acts"].dtype == torch.bfloat16
    want = torch.from_numpy(logical[2][[md.layers.index(int(v)) for v in pair["layers"]]].astype(np.float32))
    assert torch.equal(pair["acts"], want.to(torch.bfloat16))


@pytest.mark.parametrize("stack_layers", [False, True])
def test_compiled_and_numpy_dequantizing_give_the_same_batches(
    cache8: tuple[ss.Shards, Any], stack_layers: bool
) -> None:
    """The host path gathers and dequantizes a batch in one pass (numba's kernel, the `fast`
    extra) or a gather and numpy's passes: the same batches, in every output dtype."""
    pytest.importorskip("numba")
    shards, _ = cache8
    assert float8.kernels_in_use()
    for out_dtype in (None, "float32", "bfloat16"):
        kwargs: dict[str, Any] = dict(
            batch_size=9, seed=3, buffer_bytes=500, block_bytes=100, stack_layers=stack_layers, out_dtype=out_dtype,
            mix_layers=not stack_layers,
        )  # fmt: skip
        compiled = list(ShuffledLoader(shards, **kwargs))
        with float8.numpy_only():
            plain = list(ShuffledLoader(shards, **kwargs))
        assert_same_batches(compiled, plain)


def test_a_window_has_the_kernel_read_its_scales_ahead(
    cache8: tuple[ss.Shards, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local float8_e4m3 cache's loader asks the kernel to read each window's scales at once
    (POSIX_FADV_WILLNEED on the scale files): every example's scale bytes, each shard's own range."""
    shards, _ = cache8
    md = shards.metadata
    hints: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hints.append((os.fstat(fd).st_ino, offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    batches = list(ShuffledLoader(shards, batch_size=8, tokens="all", skip_padding=False, mix_layers=True))
    assert sum(len(b) for b in batches) == md.n_examples * md.n_layers * md.tokens_per_ex
    per_example = md.n_layers * md.tokens_per_ex * 4
    covered: dict[int, set[int]] = {}
    for inode, offset, length in hints:
        assert offset % per_example == 0 and length % per_example == 0
        covered.setdefault(inode, set()).update(range(offset // per_example, (offset + length) // per_example))
    inodes = {os.stat(shards.scale_path(k)).st_ino: k for k in range(shards.n_shards)}
    assert set(covered) == set(inodes)
    for inode, k in inodes.items():
        first = k * shards.examples_per_shard
        assert covered[inode] == set(range(min(shards.examples_per_shard, md.n_examples - first)))
