"""Conversion throughput: `saev-shards convert` against reading the source plus writing the cache.

For each source kind a source is built with its own library (the builders the tests use,
tests/support/sources.py), then three things are timed in the same run, interleaved:

* **read**: the whole source read with its own library, the way its users read it (pickle
  shards: ``gzip`` + ``pickle`` per shard; zarr activation logs: ``zarr`` slices of the activation arrays;
  SAELens: the ``datasets`` folder's Arrow columns as numpy; ``.npy``: ``np.load`` memmap
  copied in chunks);
* **write**: the same cache written by `ShardWriter` from float32 arrays already in memory
  (statistics on, durable, as `convert` writes), published;
* **convert**: `saev_shards.convert.convert` of the source, published.

The figure is ``(read + write) / convert``: 1.0 means converting costs exactly a read of
the source plus a write of the cache; above 1, the conversion overlaps the two (the
writer's background thread writes while the next chunk is read); below 1, conversion adds
work of its own (assembling padded examples, checksums, and for pickle shards without
``--max-tokens`` a first pass that finds the longest sequence). Sources are page-cached for all
three (built just before), so "read" is the library's decoding cost, not the disk's.

    .venv/bin/python benchmarks/convert.py [--quick]
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import saev_shards as ss
from benchmarks import benchlib as bl
from benchmarks import tables
from saev_shards.convert import Options, convert, prepare
from tests.support import sources

warnings.filterwarnings("ignore", message="Consolidated metadata")
warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")

#: Per example: 2 layers x 128 tokens x 768 dims (a BERT-base/GPT-2-small sized residual stream).
LAYERS, TOKENS, D_MODEL = 2, 128, 768


def _remove(path: Path) -> None:
    if path.exists():
        for p in [path, *path.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(path)


def _read_pickle(src: Path) -> int:
    index = json.loads((src / "metadata.json").read_text())
    total = 0
    for entry in index["shards"]:
        with gzip.open(src / entry["filename"], "rb") as f:
            shard = pickle.load(f)
        total += sum(r["activation"].nbytes for records in shard.values() for r in records)
    return total


def _read_zarr(src: Path) -> int:
    import zarr

    arrays: Any = zarr.open_group(src / "activations.zarr", mode="r")["arrays"]
    total = 0
    for name in ("prompt_activations", "response_activations"):
        arr = arrays[name]
        for a in range(0, arr.shape[0], 64):
            total += arr[a : a + 64].nbytes
    return total


def _read_saelens(src: Path) -> int:
    import datasets

    from saev_shards.convert.saelens import _numpy

    ds = datasets.load_from_disk(str(src))
    total = 0
    hooks = [k for k, f in ds.features.items() if isinstance(f, datasets.Array2D)]
    for a in range(0, len(ds), 64):
        part = ds.data.slice(a, min(64, len(ds) - a))
        for h in hooks:
            total += _numpy(part.column(h), part.num_rows, tuple(ds.features[h].shape)).nbytes
    return total


def _read_npy(src: Path) -> int:
    mm = np.load(src, mmap_mode="r")
    total = 0
    for a in range(0, len(mm), 64):
        total += np.array(mm[a : a + 64]).nbytes
    return total


def _write(root: Path, md: ss.Metadata, expected: sources.Expected) -> None:
    columns = {k: v for k, v in expected.columns.items() if k in ("lengths", "true_lengths")}
    with ss.ShardWriter(root, md, stats=True) as w:
        for a in range(0, md.n_examples, 64):
            w.write(expected.acts[a : a + 64], columns={k: v[a : a + 64] for k, v in columns.items()} or None)


def _build(kind: str, folder: Path, n: int) -> tuple[Path, sources.Expected, Callable[[Path], int]]:
    if kind == "pickle":
        per = max(1, n // 8)
        counts = tuple([per] * (n // per) + ([n % per] if n % per else []))
        exp = sources.pickle_source(folder / "src", per_shard=counts, layers=(6, 11), d_model=D_MODEL, max_len=TOKENS)
        return folder / "src", exp, _read_pickle
    if kind == "zarr":
        exp = sources.zarr_source(
            folder / "src", n=n, n_layers=LAYERS, p_max=TOKENS - 32, r_max=32, d_model=D_MODEL, prompt_chunk=TOKENS - 32
        )
        return folder / "src", exp, _read_zarr
    if kind == "saelens":
        exp = sources.saelens_source(
            folder / "src",
            n=n,
            hooks=("blocks.6.hook_resid_post", "blocks.11.hook_resid_post"),
            context_size=TOKENS,
            d_in=D_MODEL,
            num_shards=4,
        )
        return folder / "src", exp, _read_saelens
    folder.mkdir(parents=True, exist_ok=True)
    exp = sources.npy_source(folder / "src.npy", (n, LAYERS, TOKENS, D_MODEL))
    return folder / "src.npy", exp, _read_npy


def main(quick: bool = False) -> None:
    n = 64 if quick else 640
    rounds = 1 if quick else 3
    base = tables.bench_dir() / "convert"
    _remove(base)
    base.mkdir(parents=True)
    table = tables.Table(
        "convert",
        f"Conversion: {n} examples of {LAYERS} layers x {TOKENS} tokens x {D_MODEL} per source, float16 cache "
        f"with statistics, durable; median of {rounds} interleaved round(s)",
        ["source", "source MB", "cache MB", "read s", "write s", "convert s", "convert MB/s", "x (read + write)"],
    )
    # (row, source kind, options): pickle twice, as its T is found by a scan unless --max-tokens gives it
    rows = [
        ("pickle (scan for T)", "pickle", Options()),
        (f"pickle (--max-tokens {TOKENS})", "pickle", Options(max_tokens=TOKENS)),
        ("zarr", "zarr", Options()),
        ("saelens", "saelens", Options()),
        ("npy", "npy", Options()),
    ]
    for label, kind, options in rows:
        folder = base / kind
        src, expected, read = _build(kind, folder, n)
        md = prepare(src, root=folder / "out", options=options).metadata
        bl.warm_cache(src)
        times: dict[str, list[float]] = {"read": [], "write": [], "convert": []}
        for _ in range(rounds):
            t = time.perf_counter()
            read(src)
            times["read"].append(time.perf_counter() - t)
            _remove(folder / "w")
            t = time.perf_counter()
            _write(folder / "w", md, expected)
            times["write"].append(time.perf_counter() - t)
            _remove(folder / "out")
            t = time.perf_counter()
            result = convert(src, root=folder / "out", options=options)
            times["convert"].append(time.perf_counter() - t)
            if result.path.name != md.hash:
                raise RuntimeError(f"{kind}: converted {result.path.name}, planned {md.hash}")
        med = {k: statistics.median(v) for k, v in times.items()}
        src_bytes = sum(p.stat().st_size for p in ([src] if src.is_file() else src.rglob("*")) if p.is_file())
        table.add(
            label,
            src_bytes / 1e6,
            md.nbytes / 1e6,
            med["read"],
            med["write"],
            med["convert"],
            md.nbytes / med["convert"] / 1e6,
            (med["read"] + med["write"]) / med["convert"],
        )
        _remove(folder)
    table.note(f"Machine: {tables.machine()}.")
    table.note(
        "x (read + write) = (seconds to read the source with its own library + seconds for ShardWriter to write "
        "and publish the same cache from memory) / seconds to convert; 1.0 is a conversion with no overhead, "
        "above 1 the writer's background thread overlaps the reading. Sources are page-cached (just built)."
    )
    table.emit()
    _remove(base)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 examples per source, one round")
    main(quick=parser.parse_args().quick)
