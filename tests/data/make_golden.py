"""Regenerate the golden caches under tests/data. Run only when the protocol version changes:
the committed bytes are what every later release must read (and, for 3.0, write) exactly.

    .venv/bin/python -m tests.data.make_golden
"""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

import saev_shards as ss

HERE = Path(__file__).resolve().parent
SEED_KEYS = (
    "family", "ckpt", "layers", "patches_per_ex", "cls_token", "d_model",
    "n_examples", "patches_per_shard", "data", "dataset", "dtype", "protocol",
)  # fmt: skip


def golden_values(n: int, n_layers: int, tokens: int, d_model: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """v[e, l, t, d] = (e*64 + l*16 + t*4 + d) / 4 with alternating sign: exact in float16."""
    e, l_, t, d = np.meshgrid(np.arange(n), np.arange(n_layers), np.arange(tokens), np.arange(d_model), indexing="ij")
    sign = np.where((e + d) % 2 == 0, 1.0, -1.0)
    return ((e * 64 + l_ * 16 + t * 4 + d) * sign / 4).astype(np.float32)


def golden_labels(n: int, patches: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    e, p = np.meshgrid(np.arange(n), np.arange(patches), indexing="ij")
    return ((e * 7 + p) % 256).astype(np.uint8)


GOLDEN_LENGTHS = [3, 1, 2, 3, 0]
GOLDEN_PROMPTS = ["zero", "one 一", 'two "quoted"', "three\nlines", {"four": 4}]


#: The sites of the protocol 3.2 golden cache: a transcoder's pair, an MLP's input and output.
GOLDEN_SITES = (ss.Site("blocks.1.mlp", "input"), ss.Site("blocks.1.mlp", "output"))


def golden_metadata(
    protocol: str = "3.0", dtype: str = "float16", sites: tuple[ss.Site, ...] | None = None
) -> ss.Metadata:
    """The golden cache's configuration: protocol 3.0 (the committed bytes of golden-3.0), or
    3.1 in float16 or float8_e4m3 (golden-3.1), or 3.2 with ``sites`` (golden-3.2)."""
    return ss.Metadata(
        family="clip",
        ckpt="golden/ckpt",
        layers=(9, 2),
        patches_per_ex=2,
        cls_token=True,
        d_model=4,
        n_examples=5,
        patches_per_shard=13,  # 13 // (3 tokens * 2 layers) = 2 examples per shard
        data={"name": "golden", "note": "ünïcode ∑", "scale": 0.25},
        dataset="/golden",
        dtype=dtype,
        protocol=protocol,
        sites=sites,
    )


def write_golden_3(
    root: Path, protocol: str = "3.0", dtype: str = "float16", sites: tuple[ss.Site, ...] | None = None
) -> Path:
    md = golden_metadata(protocol, dtype, sites)
    values = golden_values(*md.shape)
    with ss.ShardWriter(root, md, stats=True) as w:
        for a, b in ((0, 3), (3, 5)):
            w.write(
                values[a:b],
                labels=golden_labels(md.n_examples, md.patches_per_ex)[a:b],
                columns={"lengths": np.array(GOLDEN_LENGTHS[a:b], np.int32)},
                text={"prompt": GOLDEN_PROMPTS[a:b]},
            )
    return root / md.hash


def legacy_metadata(n_examples: int) -> dict[str, Any]:
    """A seed-002 protocol 2.1 metadata object, keys in the seed's order, data as base64 pickle."""
    data = base64.b64encode(pickle.dumps({"name": "legacy", "n": n_examples})).decode("utf8")
    values: list[Any] = ["clip", "legacy/ckpt", [3, 7], 2, True, 4, n_examples, 13, data, "/legacy", "float32", "2.1"]
    return dict(zip(SEED_KEYS, values, strict=True))


def write_reference_style(root: Path, n_examples: int) -> Path:
    """Write a 2.1 cache the way the saev reference writer does: every shard memmapped at full
    size (so the last one is padded), shards.json of {name, n_examples}, and when the examples
    fill the last shard exactly, one more empty shard file and entry."""
    md = legacy_metadata(n_examples)
    digest = ss.content_hash(md)
    path = root / digest
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps(md, indent=4))
    n_layers, tokens, d_model = len(md["layers"]), md["patches_per_ex"] + 1, md["d_model"]
    eps = md["patches_per_shard"] // (tokens * n_layers)
    values = golden_values(n_examples, n_layers, tokens, d_model)
    entries = []
    shard = 0
    start = 0
    while True:
        count = min(eps, n_examples - start)
        acts = np.memmap(
            path / f"acts{shard:06}.bin", mode="w+", dtype=np.float32, shape=(eps, n_layers, tokens, d_model)
        )
        acts[:count] = values[start : start + count]
        acts.flush()
        del acts
        entries.append({"name": f"acts{shard:06}.bin", "n_examples": count})
        start += count
        shard += 1
        if start >= n_examples and (count < eps or entries[-1]["n_examples"] == 0):
            break
    labels = np.memmap(path / "labels.bin", mode="w+", dtype=np.uint8, shape=(n_examples, md["patches_per_ex"]))
    labels[:] = golden_labels(n_examples, md["patches_per_ex"])
    labels.flush()
    del labels
    (path / "shards.json").write_text(json.dumps(entries, indent=2))
    return path


#: The golden caches of protocol 3.1 (one shards root): the 3.0 cache's data in float16, and in float8_e4m3.
GOLDEN_31 = ("float16", "float8_e4m3")


def main() -> None:
    """Write the golden caches that are missing (a protocol version's caches are written once:
    delete a folder to write it again, only when its version's bytes change)."""
    writers = {
        "golden-3.0": lambda target: [write_golden_3(target)],
        "golden-3.1": lambda target: [write_golden_3(target, "3.1", dtype) for dtype in GOLDEN_31],
        "golden-3.2": lambda target: [write_golden_3(target, "3.2", "float16", GOLDEN_SITES)],
        "legacy-2.1-padded": lambda target: [write_reference_style(target, 5)],
        "legacy-2.1-divisible": lambda target: [write_reference_style(target, 4)],
    }
    for name, write in writers.items():
        target = HERE / name
        if target.exists():
            print(f"{target}: kept")
            continue
        for path in write(target):
            for p in [path, *path.rglob("*")]:  # as committed: git keeps no read-only modes
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
            print(path)


if __name__ == "__main__":
    main()
