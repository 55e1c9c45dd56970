"""On a CUDA GPU: what the CPU stand-ins of the other tests cannot show (skipped without one).

Elsewhere the device path runs with ``device="cpu"`` (plain tensors, synchronous copies, no
stream or event) and CUDA is declared present around a recorded pinned allocator. Here, on a
GPU node: host memory really page-locked; batches built on the device by side-stream
uploads and events equal to the host path's, also while the training stream lags behind
the uploads or is not the default stream; float8_e4m3 dequantized on the device equal to the
host's, bit for bit, and quantized on the device (`float8.quantize_tensor`, what a dump on a
GPU runs) equal to the host rule; a loader's state resumed on the device (and across device
and host); device memory allocated once per loader and freed by ``close``; the recorder's
side-stream copies to pinned memory, and a dump on the GPU.

`benchmarks/gpu_session.sh` runs this file on a lent GPU machine (docs/bench/gpu.md).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import saev_shards as ss
from saev_shards import loaders
from saev_shards.codecs import float8
from saev_shards.dump.recorder import AsyncWriter
from saev_shards.loaders import Batch, device, spares
from saev_shards.loaders.tensors import pinned_empty

from ...support import strategies
from ...support.caches import small_metadata, tree_bytes
from ...support.loaders import cache, keys

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Cycles of ``torch.cuda._sleep`` queued before each batch: about a millisecond at GPU clocks,
#: far longer than a small window's upload, so the side stream runs ahead of the training stream.
LAG_CYCLES = 2_000_000


def ShuffledLoader(*args: Any, **kwargs: Any) -> loaders.ShuffledLoader:
    kwargs.setdefault("mix_layers", True)  # caches of two layers, every token of every layer
    return loaders.ShuffledLoader(*args, **kwargs)


def OrderedLoader(*args: Any, **kwargs: Any) -> loaders.OrderedLoader:
    return loaders.OrderedLoader(*args, mix_layers=True, **kwargs)


def on_host(batch: Batch) -> Batch:
    """A device batch (every tensor on the GPU) copied to the host."""
    tensors = [batch.acts, batch.examples, batch.tokens, batch.layers]
    tensors += [] if batch.labels is None else [batch.labels]
    assert all(t.device.type == "cuda" for t in tensors), [t.device for t in tensors]
    return batch.to("cpu")


def assert_same(host: list[Batch], dev: list[Batch]) -> None:
    """Device batches equal to the host path's: values bit for bit, metadata, dtypes, order."""
    assert len(host) == len(dev)
    for a, gpu in zip(host, dev, strict=True):
        b = on_host(gpu)
        assert (b.acts.dtype, b.acts.shape) == (a.acts.dtype, a.acts.shape)
        if a.acts.dtype.itemsize == 2:  # float16, bfloat16: bits (NaN payloads included)
            assert torch.equal(a.acts.view(torch.int16), b.acts.view(torch.int16))
        else:
            assert torch.equal(a.acts.view(torch.int32), b.acts.view(torch.int32))
        for name in ("examples", "tokens", "layers"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert getattr(b, name).dtype == torch.int64
        assert (a.labels is None) == (b.labels is None)
        if a.labels is not None:
            assert b.labels is not None and torch.equal(a.labels, b.labels) and b.labels.dtype == torch.uint8


def capture_slots(monkeypatch: pytest.MonkeyPatch) -> list[device.Slots]:
    """Every `device.Slots` the loaders make from now on."""
    made: list[device.Slots] = []
    real = device.Slots

    def keeping(*args: Any) -> device.Slots:
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(spares, "Slots", keeping)
    return made


def float8_cache(root: Path, n_examples: int = 23, seed: int = 0) -> tuple[ss.Shards, np.ndarray[Any, Any]]:
    """A float8_e4m3 cache quantized by the writer from heavy-tailed float32 values (scales that
    are not powers of two, so dequantizing rounds), with zero vectors and vectors of tiny and
    of large values; returns it and the float32 input."""
    md = small_metadata(dtype="float8_e4m3", n_examples=n_examples)
    rng = np.random.default_rng(seed)
    spread = rng.lognormal(0, 2, md.shape[:3]).astype(np.float32)[..., None]
    x = rng.standard_normal(md.shape, dtype=np.float32) * spread
    x[1, 0, 2] = 0  # scale 0
    x[2, 1, 3] *= np.float32(1e-30)  # float16 output: zeros
    x[4, 1, 2] *= np.float32(1e-6)  # float16 output: subnormals
    x[3, 0, 1] = np.float32(60_000) * np.sign(x[3, 0, 1])  # near float16's largest
    with ss.ShardWriter(root, md, durable=False, labels=True) as w:
        w.write(x, labels=rng.integers(0, 256, (md.n_examples, md.patches_per_ex), dtype=np.uint8))
    return ss.open(root / md.hash), x


# -- pinned memory -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
@pytest.mark.parametrize("kwargs", [{}, {"out_dtype": "float32"}, {"stack_layers": True}])
def test_pinned_memory_is_page_locked(
    make_cache: Any, monkeypatch: pytest.MonkeyPatch, dtype: str, kwargs: dict[str, Any]
) -> None:
    """``pin_memory=True`` batches (host path) and the device path's host slots are
    page-locked, not just allocated by the function that asks for it."""
    assert pinned_empty((1000,), torch.float16).is_pinned()
    shards, _ = make_cache(small_metadata(dtype=dtype), labels=True)
    loader = ShuffledLoader(shards, batch_size=7, pin_memory=True, **kwargs)
    assert loader.pin_memory
    batches = list(loader)
    assert batches and all(b.acts.is_pinned() for b in batches)
    made = capture_slots(monkeypatch)
    on_device = list(ShuffledLoader(shards, batch_size=7, device="cuda", **kwargs))
    [slots] = made
    host_side = [*slots.windows, *slots.flat_host, *slots.meta_host, *slots.labels_host, *slots.scales_host]
    assert all(t.is_pinned() for t in host_side)
    assert (len(slots.scales_host) > 0) == (dtype == "float8_e4m3")
    device_side = [*slots.acts, *slots.flat, *slots.meta, *slots.labels, *slots.scales]
    assert all(t.device.type == "cuda" for t in device_side)
    assert_same(batches, on_device)


# -- the device path against the host path -------------------------------------------------


@given(strategies.metadata(max_examples=25, min_examples=1), st.data())
def test_device_batches_equal_the_host_batches(md: ss.Metadata, data: st.DataObject) -> None:
    """device="cuda": the same batches as the host path, in the same order, on the GPU."""
    kwargs: dict[str, Any] = dict(
        batch_size=data.draw(st.integers(1, 30)),
        seed=data.draw(st.integers(0, 3)),
        buffer_bytes=data.draw(st.sampled_from([1, 300, 4000, 1 << 30])),
        block_bytes=data.draw(st.sampled_from([1, 64, 1 << 22])),
        drop_last=data.draw(st.booleans()),
        stack_layers=data.draw(st.booleans()),
        out_dtype=data.draw(st.sampled_from([None, "float32", "bfloat16", "float16"])),
        ignore_labels=data.draw(st.sampled_from([(), (1, 2, 3), tuple(range(0, 256, 3))])),
    )
    if data.draw(st.booleans()):
        kwargs.update(rank=1, world_size=2)
    lengths = np.arange(md.n_examples) % (md.tokens_per_ex + 1)
    with cache(md, labels=True, lengths=lengths) as (shards, _):
        cls = data.draw(st.sampled_from([ShuffledLoader, OrderedLoader]))
        if cls is OrderedLoader:
            kwargs.pop("seed")
        host = list(cls(shards, **kwargs))
        dev = list(cls(shards, device="cuda", **kwargs))
        torch.cuda.synchronize()
        assert_same(host, dev)


@pytest.mark.parametrize("side_stream", [False, True])
def test_batches_stay_right_while_the_training_stream_lags(make_cache: Any, side_stream: bool) -> None:
    """A spin kernel before each batch keeps the training stream a millisecond behind: the
    uploads (side stream) then run ahead, and each device slot is reused many times. The
    gathers must still read their own window: the side stream waits for the ``consumed``
    event before it overwrites a slot, the training stream for ``uploaded`` before it reads
    one. The training loop may also run on a stream of its own."""
    md = small_metadata(n_examples=200, patches_per_shard=400)
    shards, _ = make_cache(md, labels=True, batches=(50,))
    kwargs: dict[str, Any] = dict(batch_size=16, seed=1, buffer_bytes=2000, block_bytes=64)
    host = list(ShuffledLoader(shards, **kwargs))
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    got: list[Batch] = []
    loader = ShuffledLoader(shards, device="cuda", **kwargs)
    assert len(loader.plan(0).windows) >= 10  # each of the two device slots reused five times or more
    with torch.cuda.stream(stream):
        it = iter(loader)
        while True:
            torch.cuda._sleep(LAG_CYCLES)
            batch = next(it, None)
            if batch is None:
                break
            got.append(batch)
    stream.synchronize()
    assert_same(host, got)


# -- float8_e4m3 -----------------------------------------------------------------------------


@pytest.mark.parametrize("stack_layers", [False, True])
@pytest.mark.parametrize("out_dtype", [None, "float16", "float32", "bfloat16"])
def test_float8_dequantized_on_the_device_equals_the_host(root: Path, stack_layers: bool, out_dtype: Any) -> None:
    """The device path moves the stored bytes and a float32 scale per vector and dequantizes
    after the gather (``float32(q) * s``, then the output dtype): bit for bit the host's
    batches (numba's kernel or numpy), rounding, subnormals and zero vectors included."""
    shards, x = float8_cache(root)
    kwargs: dict[str, Any] = dict(
        batch_size=9, seed=2, buffer_bytes=500, block_bytes=100, stack_layers=stack_layers, out_dtype=out_dtype,
        mix_layers=not stack_layers, tokens="all",
    )  # fmt: skip
    host = list(ShuffledLoader(shards, **kwargs))
    dev = list(ShuffledLoader(shards, device="cuda", **kwargs))
    assert_same(host, dev)
    want = torch.float16 if out_dtype is None else getattr(torch, out_dtype)
    assert dev[0].acts.dtype == want
    # and they are the writer's float32 input within E4M3's rounding (3 mantissa bits)
    md = shards.metadata
    for b in (on_host(b) for b in ShuffledLoader(shards, device="cuda", **{**kwargs, "out_dtype": "float32"})):
        pos = np.vectorize(md.layers.index, otypes=[np.int64])(b.layers.numpy())
        ex, tok = b.examples.numpy(), b.tokens.numpy()
        ref = x[ex[:, None], pos, tok[:, None]] if stack_layers else x[ex, pos, tok]
        assert (np.abs(b.acts.numpy() - ref) <= np.abs(ref).max(axis=-1, keepdims=True) / 16).all()


def test_float16_overflow_is_an_error_on_the_device(root: Path) -> None:
    md = small_metadata(dtype="float8_e4m3", n_examples=5)
    x = np.ones(md.shape, np.float32)
    x[3, 0, 2, 5] = 1e6
    with ss.ShardWriter(root, md, durable=False) as w:
        w.write(x)
    shards = ss.open(root / md.hash)
    with pytest.raises(ss.DtypeRangeError, match="do not fit float16"):
        list(ShuffledLoader(shards, batch_size=4, layers=6, tokens="all", device="cuda", mix_layers=False))
    wide = list(ShuffledLoader(shards, batch_size=4, layers=6, tokens="all", device="cuda", out_dtype="float32"))
    assert max(float(b.acts.max()) for b in wide) == pytest.approx(1e6, rel=1 / 16)


def quantized_on(t: torch.Tensor, where: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    q, s = float8.quantize_tensor(t.to(where))
    assert q.device.type == s.device.type == torch.device(where).type
    return q.cpu().numpy(), s.cpu().numpy()


@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=3, max_side=40),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    ),
    st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_quantizing_on_the_device_follows_the_host_rule(x: np.ndarray[Any, Any], dtype: str) -> None:
    """`float8.quantize_tensor` on a GPU (a float8 dump's path: the model's float32 output
    quantized where it is) gives the bytes and scales of the host rule (protocol.md 5): NaN
    and infinity, zero vectors, subnormal scales included."""
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    q_dev, s_dev = quantized_on(t, "cuda")
    q_host, s_host = quantized_on(t, "cpu")
    np.testing.assert_array_equal(q_dev, q_host)
    np.testing.assert_array_equal(s_dev.view(np.uint32), s_host.view(np.uint32))


def test_quantizing_on_the_device_handles_every_kind_of_vector() -> None:
    """Hand-made vectors the property test may not draw in one run: zeros, subnormal scales
    (the clamp), the largest float32, infinities, NaN, a single non-zero value."""
    d = 16
    rows = [
        np.zeros(d),
        np.full(d, 1e-44),
        np.linspace(-3e-39, 3e-39, d),
        np.linspace(-3.4e38, 3.4e38, d),
        np.r_[np.inf, np.ones(d - 1)],
        np.r_[np.nan, np.ones(d - 1)],
        np.r_[5.0, np.zeros(d - 1)],
        np.random.default_rng(0).standard_normal(d) * 1e4,
    ]
    x = torch.from_numpy(np.array(rows, np.float32))
    q_dev, s_dev = quantized_on(x, "cuda")
    q_host, s_host = quantized_on(x, "cpu")
    np.testing.assert_array_equal(q_dev, q_host)
    np.testing.assert_array_equal(s_dev.view(np.uint32), s_host.view(np.uint32))


# -- state, memory ---------------------------------------------------------------------------


def test_a_state_resumes_on_the_device_and_across_device_and_host(make_cache: Any) -> None:
    """A state taken mid-epoch resumes the rest of that epoch on the device; the state holds
    no device, so a GPU run's checkpoint resumes on the host path and the other way round."""
    md = small_metadata(n_examples=23)
    shards, _ = make_cache(md, labels=True)
    kwargs: dict[str, Any] = dict(batch_size=7, seed=4, buffer_bytes=300, block_bytes=100)
    loader = ShuffledLoader(shards, device="cuda", **kwargs)
    epochs = [list(loader) for _ in range(2)]
    assert keys([on_host(b) for b in epochs[0]]) != keys([on_host(b) for b in epochs[1]])
    host = ShuffledLoader(shards, **kwargs)
    host.set_epoch(1)
    host_epoch1 = list(host)
    assert_same(host_epoch1, epochs[1])
    for first_on, then_on in (("cuda", "cuda"), ("cuda", None), (None, "cuda")):
        start = ShuffledLoader(shards, device=first_on, **kwargs)
        start.set_epoch(1)
        it = iter(start)
        first = [next(it) for _ in range(4)]
        state = start.state_dict()
        del it
        resumed = ShuffledLoader(shards, device=then_on, **kwargs)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert all(b.acts.is_cuda == (first_on == "cuda") for b in first)
        assert all(b.acts.is_cuda == (then_on == "cuda") for b in rest)
        assert_same(host_epoch1, [b if b.acts.is_cuda else b.to("cuda") for b in first + rest])


def test_device_memory_is_allocated_once_and_freed_by_close(make_cache: Any) -> None:
    shards, _ = make_cache(small_metadata(n_examples=60, patches_per_shard=100))
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loader = ShuffledLoader(shards, batch_size=7, buffer_bytes=600, block_bytes=100, device="cuda")
    after_epoch = []
    for _ in range(3):
        for _batch in loader:
            pass
        del _batch
        gc.collect()
        torch.cuda.synchronize()
        after_epoch.append(torch.cuda.memory_allocated())
    assert after_epoch[0] > before  # the window slots, kept for the next epoch
    assert after_epoch[1] == after_epoch[2] == after_epoch[0]
    loader.close()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


# -- the recorder's copies and a dump on the GPU ---------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_async_writer_copies_cuda_tensors_on_a_side_stream(tmp_path: Path, dtype: str) -> None:
    """`AsyncWriter.submit` with tensors still being computed on the training stream: its side
    stream waits for them, copies them into pinned memory, and the allocator does not hand
    their memory to the next batch before the copy ran (``record_stream``), although the
    caller drops them at once and writes other values over freshly allocated tensors. The
    cache is byte for byte the one written directly from the same values on the host."""
    md = small_metadata(n_examples=40, patches_per_shard=60, dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(md.shape, dtype=np.float32)
    direct = tmp_path / "direct"
    with ss.ShardWriter(direct, md, durable=False) as w:
        w.write(x)
    copied = tmp_path / "async"
    pinned = []
    real_to_pinned = AsyncWriter._to_pinned

    def recording(tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        host = real_to_pinned(tensor, stream)
        pinned.append(host.is_pinned())
        return host

    with AsyncWriter(ss.ShardWriter(copied, md, durable=False)) as aw:
        aw._to_pinned = recording  # type: ignore[method-assign]
        for a in range(0, md.n_examples, 6):
            source = torch.from_numpy(x[a : a + 6]).cuda()
            torch.cuda._sleep(LAG_CYCLES)
            acts = source.clone()  # runs after the spin: not yet computed when submitted
            if dtype == "float8_e4m3":
                q, s = float8.quantize_tensor(acts)
                aw.submit(q, scales=s)
                del q, s
            else:
                aw.submit(acts.to(torch.float16))
            del acts, source
            torch.full((6, *md.shape[1:]), float("nan"), device="cuda")  # may land where they were
    assert pinned and all(pinned)
    assert tree_bytes(direct / md.hash) == tree_bytes(copied / md.hash)


def test_a_float8_dump_on_the_gpu_is_its_float32_dump_quantized(tmp_path: Path) -> None:
    """`dump` with ``device = "cuda"``: the recorder on the GPU, the float8 rule applied there
    (`float8.quantize_tensor`), one byte per value copied to the host: the cache holds the
    same GPU dump in float32 quantized by the host rule."""
    from saev_shards import dump as dump_mod

    from ...support.dumps import make_config

    def quiet(_: str) -> None:
        pass

    wide_path = dump_mod.dump(make_config(tmp_path, dtype="float32", device="cuda"), durable=False, log=quiet)
    path = dump_mod.dump(make_config(tmp_path, dtype="float8_e4m3", device="cuda"), durable=False, log=quiet)
    assert wide_path is not None and path is not None
    wide, shards = ss.open(wide_path), ss.open(path)
    shards.verify()
    values, scales = float8.quantize_numpy(wide[:])
    assert shards.scales is not None
    np.testing.assert_array_equal(shards.raw[:].view(np.uint8), values.view(np.uint8))
    np.testing.assert_array_equal(shards.scales[:], scales)
