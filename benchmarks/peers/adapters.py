"""One adapter per cache format, each with its best configuration and fastest natural read path.

Every format stores the same logical float16 tensor ``(N, L, T, D)`` from the same
`data.Source`. A `data.Format` knows how to write the whole cache (ending with every file
fsynced, as our writer does) and how to open it; the opened `data.Reader` answers the three
read patterns the workloads time:

* ``read(ex, layer, out)``: one ``(T, D)`` slice (the zarr activation logs' validation query);
* ``read_pairs(ex, layers, out)``: ``b`` examples x 2 layers, ``(b, 2, T, D)`` (their
  training pattern);
* ``gather(ex, layer, tok, out)``: ``n`` single token vectors, ``(n, D)``.

Each returns the values read, in ``out`` when the library can fill a caller's buffer
and in a new array otherwise. Layers are positions ``0..L-1`` everywhere. What each
adapter does, and why, is in its ``note`` (printed under the tables) and in
docs/contributing/benchmarks.md.
"""

from __future__ import annotations

import functools
import gzip
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import orjson

import saev_shards as ss
from benchmarks.peers.data import DTYPE, Array, CacheSpec, Format, Source, fsync_tree

# --------------------------------------------------------------------------------------
# the adapters


class _LoopReader:
    """`read_pairs` and `gather` as loops over single reads, for libraries without a batched call."""

    def read(self, ex: int, layer: int, out: Array) -> Array:
        raise NotImplementedError

    def read_vector(self, ex: int, layer: int, tok: int, out: Array) -> Array:
        raise NotImplementedError

    def read_pairs(self, ex: Array, layers: Array, out: Array) -> Array:
        for j, e in enumerate(ex.tolist()):
            for c, layer in enumerate(layers[j].tolist()):
                dst = out[j, c]
                got = self.read(e, layer, dst)
                if got is not dst:
                    dst[...] = got
        return out

    def gather(self, ex: Array, layer: Array, tok: Array, out: Array) -> Array:
        for j, (e, layer_, t) in enumerate(zip(ex.tolist(), layer.tolist(), tok.tolist(), strict=True)):
            dst = out[j]
            got = self.read_vector(e, layer_, t, dst)
            if got is not dst:
                dst[...] = got
        return out

    def close(self) -> None:
        pass


# -- saev_shards --------------------------------------------------------------------------


def _metadata(spec: CacheSpec) -> ss.Metadata:
    return ss.Metadata(
        family="bench",
        ckpt="synthetic",
        layers=tuple(range(spec.n_layers)),
        patches_per_ex=spec.tokens,
        cls_token=False,
        d_model=spec.d_model,
        n_examples=spec.n_examples,
        patches_per_shard=spec.examples_per_shard * spec.tokens * spec.n_layers,
        data={"name": "bench", "shape": list(spec.shape)},
        dataset="/synthetic",
    )


def write_saev(root: Path, spec: CacheSpec, source: Source, durable: bool = True) -> Path:
    md = _metadata(spec)
    with ss.ShardWriter(root, md, durable=durable) as w:  # checksums on, background thread
        for _, batch in source.batches():
            w.write(batch)
    return root / md.hash


class SaevReader:
    """Our copying fast path: one ``pread`` per slice straight into the caller's buffer."""

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        self.shards = ss.open(path)
        self.spec = spec

    def read(self, ex: int, layer: int, out: Array) -> Array:
        return self.shards.read_example(ex, layer, out)

    def read_pairs(self, ex: Array, layers: Array, out: Array) -> Array:
        flat = out.reshape(-1, *out.shape[2:])
        self.shards.read_examples(np.repeat(ex, layers.shape[1]), layers.reshape(-1), flat)
        return out

    def gather(self, ex: Array, layer: Array, tok: Array, out: Array) -> Array:
        return self.shards.read_vectors(ex, layer, tok, out)

    def close(self) -> None:
        self.shards.close()


class SaevViewReader:
    """Our notebook path: zero-copy memmap views (`example`, numpy indexing), then a copy."""

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        self.shards = ss.open(path)

    def read(self, ex: int, layer: int, out: Array) -> Array:
        np.copyto(out, self.shards.example(ex, layer))
        return out

    def read_pairs(self, ex: Array, layers: Array, out: Array) -> Array:
        for j, e in enumerate(ex.tolist()):
            for c, layer in enumerate(layers[j].tolist()):
                np.copyto(out[j, c], self.shards.example(e, layer))
        return out

    def gather(self, ex: Array, layer: Array, tok: Array, out: Array) -> Array:
        return self.shards[ex, layer, tok]

    def close(self) -> None:
        self.shards.close()


# -- numpy .npy ---------------------------------------------------------------------------


def write_npy(root: Path, spec: CacheSpec, source: Source, durable: bool = True) -> Path:
    path = root / "acts.npy"
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=DTYPE, shape=spec.shape)
    for start, batch in source.slabs():
        mm[start : start + len(batch)] = batch
    mm.flush()
    del mm
    fsync_tree(path, durable)
    return path


class NpyReader:
    """``np.load(mmap_mode="r")`` of the whole logical tensor; slicing plus a copy."""

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        self.mm = np.load(path, mmap_mode="r")

    def read(self, ex: int, layer: int, out: Array) -> Array:
        np.copyto(out, self.mm[ex, layer])
        return out

    def read_pairs(self, ex: Array, layers: Array, out: Array) -> Array:
        return self.mm[ex[:, None], layers]  # type: ignore[no-any-return]

    def gather(self, ex: Array, layer: Array, tok: Array, out: Array) -> Array:
        return self.mm[ex, layer, tok]  # type: ignore[no-any-return]

    def close(self) -> None:
        del self.mm


# -- zarr ---------------------------------------------------------------------------------


def _zarr() -> Any:
    import warnings

    import zarr

    # zarr warns that consolidated metadata is not in the v3 spec; we use it on purpose.
    warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
    return zarr


def write_zarr(root: Path, spec: CacheSpec, source: Source, durable: bool = True, *, sharded: bool = False) -> Path:
    zarr = _zarr()
    path = root / "acts.zarr"
    group = zarr.open_group(path, mode="w", zarr_format=3 if sharded else 2)
    _, n_layers, tokens, d_model = spec.shape
    arr = group.create_array(
        "acts",
        shape=spec.shape,
        chunks=(1, 1, tokens, d_model),
        shards=(spec.examples_per_shard, n_layers, tokens, d_model) if sharded else None,
        dtype="float16",
        compressors=None,
        filters=None,
        fill_value=0,
    )
    for start, batch in source.slabs():  # whole shards: no read-modify-write
        arr[start : start + len(batch)] = batch
    zarr.consolidate_metadata(path)
    fsync_tree(path, durable)
    return path


class ZarrReader(_LoopReader):
    """``zarr.open_consolidated(mode="r")``; basic indexing ``arr[ex, layer]`` per slice and
    ``arr[ex, layer, tok]`` per vector (``vindex`` only takes a coordinate for every axis: for
    gathers that means n x D index arrays, measured no faster and gigabytes of indices)."""

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        zarr = _zarr()
        self.arr = zarr.open_consolidated(path, mode="r")["acts"]

    def read(self, ex: int, layer: int, out: Array) -> Array:
        return self.arr[ex, layer]  # type: ignore[no-any-return]

    def read_vector(self, ex: int, layer: int, tok: int, out: Array) -> Array:
        return self.arr[ex, layer, tok]  # type: ignore[no-any-return]


# -- HDF5 ---------------------------------------------------------------------------------


def write_h5(root: Path, spec: CacheSpec, source: Source, durable: bool = True) -> Path:
    import h5py

    path = root / "acts.h5"
    _, _, tokens, d_model = spec.shape
    with h5py.File(path, "w", libver="latest") as f:
        dset = f.create_dataset("acts", shape=spec.shape, dtype=DTYPE, chunks=(1, 1, tokens, d_model))
        for start, batch in source.slabs():
            dset.write_direct(np.ascontiguousarray(batch), dest_sel=np.s_[start : start + len(batch)])
    fsync_tree(path, durable)
    return path


class H5Reader(_LoopReader):
    """``h5py.File(rdcc_nbytes=0)``; ``read_direct`` into the caller's buffer, one call per slice or vector.

    No chunk cache: random slices never hit it, and without it HDF5 reads the selected
    bytes straight into ``out`` instead of staging whole chunks (measured faster here).
    """

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        import h5py

        self.file = h5py.File(path, "r", rdcc_nbytes=0)
        self.dset = self.file["acts"]

    def read(self, ex: int, layer: int, out: Array) -> Array:
        self.dset.read_direct(out, source_sel=np.s_[ex, layer])
        return out

    def read_vector(self, ex: int, layer: int, tok: int, out: Array) -> Array:
        self.dset.read_direct(out, source_sel=np.s_[ex, layer, tok])
        return out

    def close(self) -> None:
        self.file.close()


# -- safetensors --------------------------------------------------------------------------


def _shard_file(k: int, suffix: str) -> str:
    return f"shard_{k:06d}{suffix}"


def write_safetensors(root: Path, spec: CacheSpec, source: Source, durable: bool = True) -> Path:
    from safetensors.numpy import save_file

    path = root / "acts.safetensors.d"
    path.mkdir()
    for k in range(spec.n_shards):
        save_file({"acts": np.ascontiguousarray(source.shard(k))}, str(path / _shard_file(k, ".safetensors")))
    fsync_tree(path, durable)
    return path


class SafetensorsReader(_LoopReader):
    """One ``safe_open(framework="numpy")`` per shard file, opened up front; ``get_slice`` per read."""

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        from safetensors import safe_open

        self.spec = spec
        self._handles = []
        self._slices = []
        for k in range(spec.n_shards):
            handle = safe_open(str(path / _shard_file(k, ".safetensors")), framework="numpy")
            handle.__enter__()
            self._handles.append(handle)
            self._slices.append(handle.get_slice("acts"))

    def read(self, ex: int, layer: int, out: Array) -> Array:
        k, local = divmod(ex, self.spec.examples_per_shard)
        return self._slices[k][local, layer]  # type: ignore[no-any-return]

    def read_vector(self, ex: int, layer: int, tok: int, out: Array) -> Array:
        k, local = divmod(ex, self.spec.examples_per_shard)
        return self._slices[k][local, layer, tok]  # type: ignore[no-any-return]

    def close(self) -> None:
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._slices.clear()


# -- pickle.gz (pickle shards) ----------------------------------------------------------


def write_pickle_gz(
    root: Path, spec: CacheSpec, source: Source, durable: bool = True, *, compresslevel: int = 1
) -> Path:
    path = root / "acts.pkl.gz.d"
    path.mkdir()
    shards = []
    for k in range(spec.n_shards):
        start, stop = spec.shard_range(k)
        data = source.shard(k)
        shard = {
            f"layer_{layer}": [
                {
                    "sample_idx": start + i,
                    "activation": data[i, layer],
                    "shape": data.shape[2:],
                    "text_preview": "",
                    "metadata": {"token_count": spec.tokens},
                }
                for i in range(stop - start)
            ]
            for layer in range(spec.n_layers)
        }
        name = _shard_file(k, ".pkl.gz")
        with gzip.open(path / name, "wb", compresslevel=compresslevel) as f:
            pickle.dump(shard, f, protocol=pickle.HIGHEST_PROTOCOL)
        shards.append(
            {
                "shard_id": k,
                "filename": name,
                "size_bytes": (path / name).stat().st_size,
                "num_samples": stop - start,
                "layers": list(range(spec.n_layers)),
                "sample_id_range": [start, stop - 1],
                "compressed": True,
            }
        )
    metadata = {
        "version": "1.0",
        "extraction_config": {"layers_extracted": list(range(spec.n_layers)), "max_seq_length": spec.tokens},
        "shards": shards,
        "statistics": {"total_shards": spec.n_shards, "total_samples": spec.n_examples},
    }
    (path / "metadata.json").write_bytes(orjson.dumps(metadata))
    fsync_tree(path, durable)
    return path


class PickleGzReader(_LoopReader):
    """The pickle shards' reader: ``metadata.json`` up front, then whole shards (``gzip`` + ``pickle``),
    keeping the current one, as its ``ActivationDataset`` does."""

    def __init__(self, path: Path, spec: CacheSpec) -> None:
        self.path = path
        self.metadata = orjson.loads((path / "metadata.json").read_bytes())
        self.starts = [s["sample_id_range"][0] for s in self.metadata["shards"]]
        self.current: tuple[int, dict[str, Any]] | None = None

    def _shard(self, k: int) -> dict[str, Any]:
        if self.current is None or self.current[0] != k:
            self.current = None  # free the previous shard first
            with gzip.open(self.path / self.metadata["shards"][k]["filename"], "rb") as f:
                self.current = (k, pickle.load(f))
        return self.current[1]

    def _locate(self, ex: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, ex, side="right")) - 1
        return k, ex - self.starts[k]

    def read(self, ex: int, layer: int, out: Array) -> Array:
        k, local = self._locate(ex)
        return self._shard(k)[f"layer_{layer}"][local]["activation"]  # type: ignore[no-any-return]

    def read_vector(self, ex: int, layer: int, tok: int, out: Array) -> Array:
        k, local = self._locate(ex)
        return self._shard(k)[f"layer_{layer}"][local]["activation"][tok]  # type: ignore[no-any-return]

    def gather(self, ex: Array, layer: Array, tok: Array, out: Array) -> Array:
        # Grouped by shard, so each shard is decompressed once per batch (the best this format allows).
        order = np.argsort(ex, kind="stable")
        for j in order.tolist():
            out[j] = self.read_vector(int(ex[j]), int(layer[j]), int(tok[j]), out[j])
        return out

    def close(self) -> None:
        self.current = None


# --------------------------------------------------------------------------------------
# the registry

FORMATS: dict[str, Format] = {
    f.key: f
    for f in [
        Format(
            "saev",
            "saev_shards",
            "ours: `read_example` (one pread per slice into a reused buffer), `read_examples` for "
            "batches, `read_vectors` for gathers (file order, one preadv per run of adjacent vectors); "
            "written by `ShardWriter` "
            "(xxh3 checksums, background thread, fsync)",
            write_saev,
            SaevReader,
        ),
        Format(
            "saev_view",
            "saev_shards view",
            "ours, notebook path: `example()` memmap view + `np.copyto`; gathers by numpy indexing "
            "`shards[ex, layer, tok]` on the memmaps (same files as saev_shards)",
            write_saev,
            SaevViewReader,
            files_of="saev",
        ),
        Format(
            "npy",
            "numpy .npy",
            "one `.npy` of the whole (N, L, T, D) tensor written through `open_memmap`; read with "
            "`np.load(mmap_mode='r')`: slice + `np.copyto`, fancy indexing for batches and gathers",
            write_npy,
            NpyReader,
        ),
        Format(
            "zarr2",
            "zarr v2",
            "the zarr activation logs' layout: zarr v2 directory store, chunks (1, 1, T, D), no compressor or "
            "filters, "
            "consolidated metadata; `arr[ex, layer]` per slice, `arr[ex, layer, tok]` per vector",
            functools.partial(write_zarr, sharded=False),
            ZarrReader,
        ),
        Format(
            "zarr3",
            "zarr v3 sharded",
            "zarr v3 with the sharding codec: inner chunks (1, 1, T, D) inside shards of our shard's "
            "shape (one file per shard), no compressor, consolidated metadata; same read calls as zarr v2",
            functools.partial(write_zarr, sharded=True),
            ZarrReader,
        ),
        Format(
            "h5",
            "HDF5 (h5py)",
            "one HDF5 file, chunks (1, 1, T, D), no filters, libver='latest'; opened with rdcc_nbytes=0; "
            "`read_direct` into the caller's buffer, one call per slice or vector (h5py has no "
            "multi-axis point selection)",
            write_h5,
            H5Reader,
        ),
        Format(
            "safetensors",
            "safetensors",
            "one `.safetensors` file per shard (tensor `acts`, shape (S, L, T, D)); every file "
            "`safe_open(framework='numpy')` at open, `get_slice('acts')[ex, layer]` per slice or vector",
            write_safetensors,
            SafetensorsReader,
        ),
        Format(
            "pickle_gz",
            "pickle.gz",
            "pickle shards: one gzip'd pickle per shard (per-layer lists of per-sample dicts, float16 here "
            "instead of the format's float32 so the data is identical; gzip level 1, its fastest) plus "
            "metadata.json; reads load whole shards and keep the current one, gathers grouped by shard",
            write_pickle_gz,
            PickleGzReader,
        ),
    ]
}
