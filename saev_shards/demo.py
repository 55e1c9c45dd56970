"""`make demo`: write a synthetic cache, open it, print a summary and a few reads."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import saev_shards as ss


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="saev-demo-")) / "shards"
    md = ss.Metadata(
        family="clip",
        ckpt="synthetic/ViT-S-16",
        layers=(6, 11),
        patches_per_ex=196,
        cls_token=True,
        d_model=384,
        n_examples=2_000,
        patches_per_shard=200_000,
        data={"name": "synthetic", "seed": 0},
        dataset="/nonexistent/synthetic",
    )
    print(
        f"writing {md.n_examples} examples x {md.n_layers} layers x {md.tokens_per_ex} tokens x {md.d_model} "
        f"({md.dtype}) to {out}/{md.hash[:12]}... in {md.n_shards} shards"
    )
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    with ss.ShardWriter(out, md, stats=True) as w:
        for _ in range(0, md.n_examples, 100):
            batch = rng.standard_normal((100, *md.shape[1:]), dtype=np.float32).astype(np.float16)
            w.write(batch, labels=rng.integers(0, 10, (100, md.patches_per_ex), dtype=np.uint8))
    dt = time.perf_counter() - t
    print(f"wrote {md.nbytes / 1e9:.2f} GB in {dt:.2f} s ({md.nbytes / dt / 1e9:.2f} GB/s, random numbers included)")
    shards = ss.open(out / md.hash)
    print(shards)
    print("example(17, layer=11):", shards.example(17, 11).shape, shards.example(17, 11).dtype)
    print("locate(1234, layer=6, token=5):", shards.locate(1234, 6, 5))
    print("shards[990:1010, 1, 0].shape (crosses a shard boundary):", shards[990:1010, 1, 0].shape)
    print("labels[:2, :8]:", shards.labels[:2, :8].tolist() if shards.labels is not None else None)
    stats = shards.stats
    if stats is not None:
        print("per-layer mean |x|^2:", np.round(stats["norm_sq_mean"], 2).tolist())
    print(f"verify: {shards.verify() / 1e9:.2f} GB checked, all checksums match")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
