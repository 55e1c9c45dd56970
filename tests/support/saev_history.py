"""Caches in saev's earlier on-disk formats, written the way each version's own writer wrote them.

Independent of the library: each format's facts are taken from saev's sources (github
OSU-NLP-Group/saev; the commits are named per format) and restated here: its ``Metadata``
dataclass fields in declaration order (metadata.json's keys), how ``dump`` wrote the file
(``json.dump(..., indent=4)`` or ``orjson.dumps(..., option=OPT_INDENT_2)``), the ``hash``
property behind the directory name, and its ``ShardWriter``: a memmap of the full shard shape
``(S, L, T, D)`` opened before the first batch and again as soon as one fills (so the last file
is zero-padded, and one more all-zero file follows a shard filled exactly), shards.json (from
1.0.0) appended at every flush with the shard's fill, and a ``LabelsWriter`` memmap
``(n_imgs, n_patches)`` uint8 (from 1.1 with pixel_agg). The fixtures under
tests/data/saev-history are caches written by that code itself; `build` reproduces their bytes
(checked by the tests), then writes any shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

DATA = Path(__file__).resolve().parents[1] / "data" / "saev-history"


@dataclasses.dataclass(frozen=True)
class Format:
    """One of saev's earlier formats, as its writer wrote it."""

    #: The folder of its fixture under tests/data/saev-history, and the library's dialect name.
    folder: str
    dialect: str
    #: metadata.json's keys in field order; the names of the model, patches, width, count and
    #: budget keys among them.
    keys: tuple[str, ...]
    family_key: str
    ckpt_key: str
    patches_key: str
    width_key: str
    count_key: str
    budget_key: str
    #: "json": sha256 of json.dumps(fields, sort_keys=True); "json-compact": the same with
    #: separators (",", ":"); "orjson": orjson.dumps of the dataclass with OPT_SORT_KEYS
    #: (fields in declaration order, the keys of dicts inside sorted).
    hash_rule: str
    #: How metadata.json and shards.json were written: "json" (json.dump, indent 4 and 2) or "orjson" (indent 2).
    writer: str
    #: shards.json's count key; None: no shards.json.
    manifest_count: str | None
    labels: bool
    protocol: str | None
    data_is_string: bool


_PRE = ("layers", "n_patches_per_img", "cls_token", "d_vit", "seed", "n_imgs", "n_patches_per_shard", "data")
_V1 = (
    "vit_family", "vit_ckpt", "layers", "n_patches_per_img", "cls_token", "d_vit", "n_imgs", "max_patches_per_shard",
    "data",
)  # fmt: skip
_V2 = (
    "family", "ckpt", "layers", "content_tokens_per_example", "cls_token", "d_model", "n_examples",
    "max_tokens_per_shard", "data", "dataset", "pixel_agg", "dtype", "protocol",
)  # fmt: skip
_VIT = dict(family_key="vit_family", ckpt_key="vit_ckpt", patches_key="n_patches_per_img", width_key="d_vit",
            count_key="n_imgs")  # fmt: skip
_TOKENS = dict(family_key="family", ckpt_key="ckpt", patches_key="content_tokens_per_example", width_key="d_model",
               count_key="n_examples", budget_key="max_tokens_per_shard")  # fmt: skip

_ALL = (
        # 9d4cae4 saev/activations.py
        Format("pre0.1-model_org", "saev-pre0.1-model_org", ("model_org", "model_ckpt", *_PRE), "model_org",
               "model_ckpt", "n_patches_per_img", "d_vit", "n_imgs", "n_patches_per_shard", "json", "json", None,
               False, None, True),
        # 7d346f4 saev/activations.py
        Format("pre0.1-model_family", "saev-pre0.1-model_family", ("model_family", "model_ckpt", *_PRE),
               "model_family", "model_ckpt", "n_patches_per_img", "d_vit", "n_imgs", "n_patches_per_shard", "json",
               "json", None, False, None, True),
        # c6e3552 src/saev/activations.py (saev==0.1.0)
        Format("0.1.0-pypi", "saev-0.1.0", ("vit_family", "vit_ckpt", *_PRE), **_VIT,
               budget_key="n_patches_per_shard", hash_rule="json", writer="json", manifest_count=None, labels=False,
               protocol=None, data_is_string=True),
        # 1c842cc src/saev/data/writers.py
        Format("1.0.0", "saev-1.0.0", (*_V1, "dtype", "protocol"), **_VIT, budget_key="max_patches_per_shard",
               hash_rule="json-compact", writer="json", manifest_count="n_imgs", labels=False, protocol="1.0.0",
               data_is_string=False),
        # 9179aa0 src/saev/data/writers.py
        Format("1.1", "saev-1.1", (*_V1, "dtype", "protocol"), **_VIT, budget_key="max_patches_per_shard",
               hash_rule="json-compact", writer="json", manifest_count="n_imgs", labels=False, protocol="1.1",
               data_is_string=False),
        # 70cd3b4 src/saev/data/writers.py
        Format("1.1-pixel_agg", "saev-1.1-pixel_agg", (*_V1, "pixel_agg", "dtype", "protocol"), **_VIT,
               budget_key="max_patches_per_shard", hash_rule="json-compact", writer="json", manifest_count="n_imgs",
               labels=True, protocol="1.1", data_is_string=False),
        # 5d0f89c src/saev/data/shards.py
        Format("2.0-json", "saev-2.0-json", _V2, **_TOKENS, hash_rule="json-compact", writer="json",
               manifest_count="n_examples", labels=True, protocol="2.0", data_is_string=False),
        # c3dd0ae src/saev/data/shards.py
        Format("2.0-orjson", "saev-2.0-orjson", _V2, **_TOKENS, hash_rule="orjson", writer="orjson",
               manifest_count="n_examples", labels=True, protocol="2.0", data_is_string=False),
)  # fmt: skip
FORMATS: dict[str, Format] = {f.folder: f for f in _ALL}


def fixtures() -> list[tuple[Format, Path, Path]]:
    """``(format, cache folder, folder of expected_*.npy)`` of every fixture cache."""
    out = []
    for fmt in FORMATS.values():
        for case in sorted((DATA / fmt.folder).iterdir()):
            (cache,) = (case / "shards").iterdir()
            out.append((fmt, cache, case))
    return out


def name_of(fmt: Format, fields: dict[str, Any]) -> str:
    """The directory name, by the format's own ``hash`` property."""
    if fmt.hash_rule == "json":
        data = json.dumps(fields, sort_keys=True).encode()
    elif fmt.hash_rule == "json-compact":
        data = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    else:
        data = b"{" + b",".join(orjson.dumps(k) + b":" + orjson.dumps(v, option=orjson.OPT_SORT_KEYS)
                                for k, v in fields.items()) + b"}"  # fmt: skip
    return hashlib.sha256(data).hexdigest()


def dumps(fmt: Format, obj: Any, indent: int) -> bytes:
    """A JSON file as the format's writer wrote it (no final newline)."""
    if fmt.writer == "orjson":
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2)
    return json.dumps(obj, indent=indent).encode()


def fields_for(
    fmt: Format,
    *,
    layers: list[int],
    patches: int,
    cls_token: bool,
    d: int,
    n: int,
    budget: int,
    family: str = "clip",
    ckpt: str = "ViT-B-16/openai",
    seed: int = 42,
    pixel_agg: str | None = None,
    data: Any = None,
    dataset: str = "/data/images",
) -> dict[str, Any]:
    """metadata.json's fields in the format's field order."""
    if data is None:
        data = "ImageFolderDataset(root='/data/images')" if fmt.data_is_string else {"n_imgs": n, "__class__": "Fake"}
    values = {
        fmt.family_key: family,
        fmt.ckpt_key: ckpt,
        "layers": list(layers),
        fmt.patches_key: patches,
        "cls_token": cls_token,
        fmt.width_key: d,
        "seed": seed,
        fmt.count_key: n,
        fmt.budget_key: budget,
        "data": data,
        "dataset": dataset,
        "pixel_agg": pixel_agg,
        "dtype": "float32",
        "protocol": fmt.protocol,
    }
    return {k: values[k] for k in fmt.keys}


class _Writer:
    """The ShardWriter every version had (its ``__setitem__``, ``flush`` and ``next_shard``)."""

    def __init__(self, folder: Path, fmt: Format, shape: tuple[int, int, int, int]) -> None:
        self.folder, self.fmt, self.shape = folder, fmt, shape
        self.per_shard = shape[0]
        self.shard = -1
        self.acts: np.memmap[Any, Any] | None = None
        self.filled = 0
        self.info: list[dict[str, Any]] = []
        self.next_shard()

    def __setitem__(self, i: slice, val: npt.NDArray[np.float32]) -> None:
        a, b = i.start, i.stop
        offset = self.per_shard * self.shard
        assert self.acts is not None
        if b >= offset + self.per_shard:
            n_fit = offset + self.per_shard - a
            self.acts[a - offset : a - offset + n_fit] = val[:n_fit]
            self.filled = a - offset + n_fit
            self.next_shard()
            self[a + n_fit : b] = val[n_fit:]
        else:
            self.acts[a - offset : b - offset] = val
            self.filled = b - offset

    def flush(self) -> None:
        if self.acts is not None:
            self.acts.flush()
            if self.fmt.manifest_count is not None:
                self.info.append({"name": f"acts{self.shard:06}.bin", self.fmt.manifest_count: self.filled})
                (self.folder / "shards.json").write_bytes(dumps(self.fmt, self.info, 2))
        self.acts = None

    def next_shard(self) -> None:
        self.flush()
        self.shard += 1
        path = self.folder / f"acts{self.shard:06}.bin"
        self.acts = np.memmap(path, mode="w+", dtype=np.float32, shape=self.shape)
        self.filled = 0


def build(
    root: Path,
    fmt: Format,
    fields: dict[str, Any],
    acts: npt.NDArray[np.float32],
    labels: npt.NDArray[np.uint8] | None = None,
    batch: int = 3,
) -> Path:
    """Write a cache of ``fields`` holding ``acts`` ``(n, L, T, D)`` (and ``labels`` ``(n, P)``)
    as the format's writer did, in batches of ``batch`` examples; returns its folder."""
    folder = root / name_of(fmt, fields)
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_bytes(dumps(fmt, fields, 4))
    n, n_layers, tokens, d = acts.shape
    per_shard = fields[fmt.budget_key] // (n_layers * tokens)
    writer = _Writer(folder, fmt, (per_shard, n_layers, tokens, d))
    label_map = None
    if labels is not None:
        label_map = np.memmap(folder / "labels.bin", mode="w+", dtype=np.uint8, shape=labels.shape)
    for a in range(0, n, batch):
        b = min(n, a + batch)
        writer[a:b] = acts[a:b]
        if label_map is not None:
            label_map[a:b] = labels[a:b]  # type: ignore[index]
    writer.flush()
    if label_map is not None:
        label_map.flush()
        del label_map
    return folder


def truncate_last(folder: Path, fields: dict[str, Any], fmt: Format, example_nbytes: int) -> None:
    """Drop the padding of the last shard by hand: its file cut to its examples."""
    n = fields[fmt.count_key]
    tokens = fields[fmt.patches_key] + int(fields["cls_token"])
    per_shard = fields[fmt.budget_key] // (len(fields["layers"]) * tokens)
    last = (n - 1) // per_shard
    os.truncate(folder / f"acts{last:06d}.bin", (n - last * per_shard) * example_nbytes)
