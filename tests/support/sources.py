"""Conversion sources built with each format's own library, following its spec, and what they hold.

* seed 001 pickle shards: ``pickle`` + ``gzip`` and ``hashlib`` for the checksums;
* seed 000 zarr logs: ``zarr`` (v2 stores, no compressor, chunks (1, 1, T_chunk, H));
* SAELens caches: ``datasets`` (``Array2D`` per hook, ``token_ids``, ``save_to_disk``);
* plain arrays: ``numpy.save``.

Each builder returns the examples as the converted cache must hold them (`Expected`).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass
class Expected:
    """The logical tensor (float32, zero padding), layers, and per-example columns and text."""

    acts: npt.NDArray[np.float32]
    layers: tuple[int, ...]
    columns: dict[str, npt.NDArray[Any]]
    text: dict[str, list[Any]]


# --------------------------------------------------------------------------------------
# seed 001: pickle shards


def pickle_source(
    folder: Path,
    *,
    per_shard: tuple[int, ...] = (4, 3, 5),
    layers: tuple[int, ...] = (15, 16),
    d_model: int = 8,
    max_len: int = 9,
    compressed: bool = True,
    checksums: bool = True,
    protocol: int = pickle.HIGHEST_PROTOCOL,
    seed: int = 0,
) -> Expected:
    """Seed 001's layout: metadata.json + shard_NNNN.pkl.gz, variable seq_len, metadata per record."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    n = sum(per_shard)
    true_lengths = rng.integers(1, max_len + 1, n)
    true_lengths[0] = max_len  # the longest is known
    acts = np.zeros((n, len(layers), max_len, d_model), np.float32)
    previews = [f"sample {i}: a preview, é ✓" for i in range(n)]
    entries = []
    first = 0
    for k, count in enumerate(per_shard):
        shard: dict[str, list[dict[str, Any]]] = {f"layer_{layer}": [] for layer in layers}
        for i in range(first, first + count):
            sample_idx = 1000 + 7 * i  # global ids, not positions
            for li, layer in enumerate(layers):
                act = rng.standard_normal((int(true_lengths[i]), d_model), dtype=np.float32)
                acts[i, li, : true_lengths[i]] = act
                shard[f"layer_{layer}"].append(
                    {
                        "sample_idx": sample_idx,
                        "activation": act,
                        "shape": act.shape,
                        "text_preview": previews[i],
                        "metadata": {
                            "token_count": int(true_lengths[i]),
                            "dataset_idx": 5000 + i,
                            "machine_id": k % 2,
                            "score": 0.5 * i,
                            "split": "train" if i % 3 else "val",
                        },
                    }
                )
        name = f"shard_{k + 1:04d}.pkl" + (".gz" if compressed else "")
        payload = pickle.dumps(shard, protocol=protocol)
        data = gzip.compress(payload, compresslevel=1, mtime=0) if compressed else payload
        (folder / name).write_bytes(data)
        entry: dict[str, Any] = {
            "shard_id": k + 1,
            "filename": name,
            "size_bytes": len(data),
            "num_samples": count,
            "layers": list(layers),
            "sample_id_range": [1000 + 7 * first, 1000 + 7 * (first + count - 1)],
            "compressed": compressed,
        }
        if checksums:
            entry["checksum"] = "sha256:" + hashlib.sha256(data).hexdigest()
        entries.append(entry)
        first += count
    metadata = {
        "version": "1.0",
        "created_at": "2025-01-09T12:00:00Z",
        "extraction_config": {
            "model_name": "Qwen/Qwen2.5-7B",
            "model_architecture": "qwen2",
            "model_params": {"hidden_size": d_model},
            "dataset_name": "HuggingFaceFW/fineweb-edu",
            "layers_extracted": list(layers),
            "max_seq_length": max_len,
        },
        "distributed_config": {"machine_id": 0, "total_machines": 1},
        "shards": entries,
        "statistics": {"total_shards": len(per_shard), "total_samples": n, "layers_extracted": list(layers)},
    }
    (folder / "metadata.json").write_text(json.dumps(metadata, indent=2))
    ids = np.arange(n)
    return Expected(
        acts,
        layers,
        {
            "lengths": true_lengths.astype(np.int32),
            "true_lengths": true_lengths.astype(np.int32),
            "sample_idx": (1000 + 7 * ids).astype(np.int64),
            "token_count": true_lengths.astype(np.int64),
            "dataset_idx": (5000 + ids).astype(np.int64),
            "machine_id": np.repeat(np.arange(len(per_shard)) % 2, per_shard).astype(np.int64),
            "score": (0.5 * ids).astype(np.float64),
        },
        {"text_preview": previews, "split": ["train" if i % 3 else "val" for i in range(n)]},
    )


def rewrite_index(folder: Path, change: Any) -> None:
    """Apply ``change(metadata_dict)`` to a pickle source's metadata.json."""
    path = folder / "metadata.json"
    metadata = json.loads(path.read_text())
    change(metadata)
    path.write_text(json.dumps(metadata))


# --------------------------------------------------------------------------------------
# seed 000: zarr activation logs


def _zarr() -> Any:
    import warnings

    import zarr

    warnings.filterwarnings("ignore", message="Consolidated metadata", category=UserWarning)
    # seed 000 keeps text/ and meta/ (JSON Lines) inside the store, which zarr warns about
    warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
    return zarr


def _zarr_store(
    path: Path,
    prompt: npt.NDArray[Any],
    response: npt.NDArray[Any],
    plen: Any,
    rlen: Any,
    first_id: int,
    extra: bool,
    prompt_chunk: int = 4,
) -> None:
    zarr = _zarr()
    n, n_layers, p_max, h = prompt.shape
    root = zarr.open_group(path, mode="w", zarr_format=2)
    root.attrs.update(
        {
            "schema_version": 1,
            "model_id": "Qwen/Qwen2.5-0.5B",
            "num_layers": n_layers,
            "hidden_size": h,
            "dtype": "float16",
            "prompt_truncated_count": 0,
        }
    )
    arrays = root.create_group("arrays")
    for name, data, t_chunk in (
        ("prompt_activations", prompt, min(prompt_chunk, p_max)),
        ("response_activations", response, response.shape[2]),
    ):
        arr = arrays.create_array(
            name,
            shape=data.shape,
            chunks=(1, 1, t_chunk, h),
            dtype="float16",
            compressors=None,
            filters=None,
            fill_value=0,
        )
        arr[:] = data
    for name, values, dtype in (
        ("prompt_len", plen, "int32"),
        ("response_len", rlen, "int32"),
        ("hallu_label", (np.arange(n) + first_id) % 2, "int8"),
        ("split", (np.arange(n) + first_id) % 3, "int8"),
    ):
        arr = arrays.create_array(name, shape=(n,), chunks=(max(1, n),), dtype=dtype, compressors=None, fill_value=0)
        arr[:] = np.asarray(values, dtype)
    keys = np.array([hashlib.sha256(str(first_id + i).encode()).hexdigest().encode() for i in range(n)], dtype="S64")
    arr = arrays.create_array("sample_key", shape=(n,), chunks=(max(1, n),), dtype="|S64", compressors=None)
    arr[:] = keys
    (path / "text").mkdir()
    lines = [
        {"i": i, "sample_key": keys[i].decode(), "prompt": f"question {first_id + i}?"} for i in reversed(range(n))
    ]  # out of order on purpose: placed by "i"
    (path / "text" / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if extra:
        (path / "meta").mkdir()
        (path / "meta" / "config.json").write_text(json.dumps({"T_chunk_prompt": 4, "R_max": response.shape[2]}))
    zarr.consolidate_metadata(path)


def zarr_source(
    folder: Path,
    *,
    n: int = 7,
    n_layers: int = 2,
    p_max: int = 6,
    r_max: int = 4,
    d_model: int = 8,
    shards: tuple[int, ...] | None = None,
    seed: int = 0,
    prompt_chunk: int = 4,
) -> Expected:
    """Seed 000's store (``folder/activations.zarr``), or its sharded layout when ``shards`` gives the counts."""
    rng = np.random.default_rng(seed)
    prompt = np.zeros((n, n_layers, p_max, d_model), np.float16)
    response = np.zeros((n, n_layers, r_max, d_model), np.float16)
    plen = rng.integers(1, p_max + 1, n)
    rlen = rng.integers(0, r_max + 1, n)
    plen[0], rlen[0] = p_max, r_max
    for i in range(n):
        prompt[i, :, : plen[i]] = rng.standard_normal((n_layers, int(plen[i]), d_model), dtype=np.float32)
        response[i, :, : rlen[i]] = rng.standard_normal((n_layers, int(rlen[i]), d_model), dtype=np.float32)
    if shards is None:
        _zarr_store(folder / "activations.zarr", prompt, response, plen, rlen, 0, extra=True, prompt_chunk=prompt_chunk)
    else:
        (folder / "shards").mkdir(parents=True)
        first = 0
        manifest = []
        for k, count in enumerate(shards):
            sl = slice(first, first + count)
            name = f"shard-{k:04d}.zarr"
            _zarr_store(folder / "shards" / name, prompt[sl], response[sl], plen[sl], rlen[sl], first, extra=k == 0)
            manifest.append({"path": f"shards/{name}", "n_samples": count, "first": first})
            first += count
        (folder / "manifest.json").write_text(json.dumps({"shards": manifest}))
    tokens = p_max + r_max
    acts = np.zeros((n, n_layers, tokens, d_model), np.float32)
    for i in range(n):
        acts[i, :, : plen[i]] = prompt[i, :, : plen[i]]
        acts[i, :, plen[i] : plen[i] + rlen[i]] = response[i, :, : rlen[i]]
    ids = np.arange(n)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in ids]
    return Expected(
        acts,
        tuple(range(n_layers)),
        {
            "lengths": (plen + rlen).astype(np.int32),
            "true_lengths": (plen + rlen).astype(np.int32),
            "prompt_len": plen.astype(np.int32),
            "response_len": rlen.astype(np.int32),
            "hallu_label": (ids % 2).astype(np.int8),
            "split": (ids % 3).astype(np.int8),
        },
        {
            "sample_key": keys,
            "prompts": [
                {
                    "i": int(i if shards is None else i - _first(shards, int(i))),
                    "sample_key": keys[i],
                    "prompt": f"question {i}?",
                }
                for i in ids
            ],
        },
    )


def _first(counts: tuple[int, ...], i: int) -> int:
    """First global index of the shard holding sample ``i``."""
    start = 0
    for c in counts:
        if i < start + c:
            return start
        start += c
    raise IndexError(i)


# --------------------------------------------------------------------------------------
# SAELens


def saelens_source(
    folder: Path,
    *,
    n: int = 9,
    hooks: tuple[str, ...] = ("blocks.3.hook_resid_post", "blocks.1.hook_resid_post"),
    context_size: int = 6,
    d_in: int = 8,
    dtype: str = "float32",
    num_shards: int = 2,
    seed: int = 0,
) -> Expected:
    """What SAELens' cache runner saves: Array2D((context_size, d_in)) per hook + token_ids, save_to_disk."""
    from datasets import Array2D, Dataset, Features, List, Value

    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n, len(hooks), context_size, d_in), dtype=np.float32).astype(dtype)
    token_ids = rng.integers(0, 50_000, (n, context_size)).astype(np.int32)
    features: dict[str, Any] = {h: Array2D(shape=(context_size, d_in), dtype=dtype) for h in hooks}
    features["token_ids"] = List(Value("int32"), length=context_size)
    columns: dict[str, Any] = {h: acts[:, i] for i, h in enumerate(hooks)}
    columns["token_ids"] = token_ids
    ds = Dataset.from_dict(columns, features=Features(features))
    ds.save_to_disk(str(folder), num_shards=num_shards)
    layers = tuple(int(h.split(".")[1]) for h in hooks)
    return Expected(acts.astype(np.float32), layers, {"token_ids": token_ids}, {})


# --------------------------------------------------------------------------------------
# .npy


def npy_source(
    path: Path, shape: tuple[int, int, int, int] = (11, 3, 5, 8), *, fortran: bool = False, seed: int = 0
) -> Expected:
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal(shape, dtype=np.float32)
    np.save(path, np.asfortranarray(acts) if fortran else acts)
    return Expected(acts, tuple(range(shape[1])), {}, {})


def assert_converted(shards: Any, expected: Expected, dtype: str = "float16") -> None:
    """Every value, layer, length, column and text of ``shards`` equals what the source held."""
    import saev_shards as ss
    from saev_shards.codecs.bfloat16 import float32_to_bf16

    assert shards.metadata.layers == expected.layers
    assert shards.shape == expected.acts.shape
    stored = ss.to_float32(shards[:], dtype)
    if dtype == "float32":
        want = expected.acts
    elif dtype == "float16":
        want = expected.acts.astype(np.float16).astype(np.float32)
    else:
        want = ss.bf16_to_float32(float32_to_bf16(expected.acts))
    np.testing.assert_array_equal(stored, want)
    for name, column in expected.columns.items():
        np.testing.assert_array_equal(shards.columns[name], column, err_msg=name)
    for name, text in expected.text.items():
        assert list(shards.text(name)) == text, name
