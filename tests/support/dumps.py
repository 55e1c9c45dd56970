"""A small dump configuration (a tiny model over a generated JSONL dataset) for the dump tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

T = 12  # [CLS] + 11 content tokens
LAYERS = [3, 1]  # deliberately not sorted: data lands in this order


def write_dataset(path: Path, n: int) -> list[dict[str, Any]]:
    """A JSONL dataset whose texts are shorter than, equal to and longer than T tokens."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(n):
        length = int(rng.integers(1, 2 * T))
        text = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, length))
        records.append({"text": text, "uid": f"ex-{i:03d}", "label": i % 3, "split": "val" if i % 4 == 0 else "train"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def make_config(tmp_path: Path, n: int = 23, **changes: Any) -> dict[str, Any]:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_dataset(data, n)
    cfg: dict[str, Any] = {
        "root": str(tmp_path / "shards"),
        "layers": LAYERS,
        "T": T,
        "dtype": "float16",
        "batch_size": 3,  # does not divide the 5 examples per shard: batches are cut at shard ends
        "patches_per_shard": 5 * T * len(LAYERS),
        "device": "cpu",
        "model": {
            "factory": "tests.support.models:tiny_text_model",
            "kwargs": {"d_model": 16, "n_blocks": 4, "max_len": T},
            "cls_token": True,
        },
        "dataset": {
            "kind": "jsonl",
            "path": str(data),
            "id_field": "uid",
            "columns": {"label": "int64"},
            "text_fields": ["split"],
        },
    }
    cfg.update(changes)
    return cfg
