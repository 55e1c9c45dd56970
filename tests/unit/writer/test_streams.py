"""writer.streams: every stream is cut at shard boundaries into part files whose part record
(``part<06d>.json``) seals each shard with the sizes and digests of what was written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import xxhash

import saev_shards as ss
from saev_shards.protocol.staging import part_file, part_record, staging_dir
from saev_shards.writer.streams import StreamSpec

from ...support.caches import small_metadata


def test_the_part_records_seal_what_each_part_holds(root: Path) -> None:
    md = small_metadata(n_examples=13, dtype="float32")
    rng = np.random.default_rng(1)
    acts = rng.standard_normal(md.shape).astype(np.float32)
    lengths = rng.integers(0, 6, 13).astype(np.int32)
    prompts = [f"prompt {i} é" for i in range(13)]
    w = ss.ShardWriter(root, md, rank=1, world_size=2, durable=False, columns={"lengths": ("int32", ())})
    assert (w.start, w.stop) == (5, 13)  # this rank's shards: 1 and 2 (5 and 3 examples)
    for a, b in [(5, 7), (7, 12), (12, 13)]:  # batches across the shard boundary
        w.write(acts[a:b], columns={"lengths": lengths[a:b]}, text={"prompt": prompts[a:b]})
    assert w.close() is None  # the other rank's shard is missing: nothing published
    staging = staging_dir(root, md)
    for k in (1, 2):
        record = json.loads((staging / part_record(k)).read_bytes())
        a, b = 5 * k, min(5 * k + 5, 13)
        shard = (staging / part_file(k, "acts")).read_bytes()
        assert shard == acts[a:b].tobytes()
        assert record["shard"] == k and record["n_examples"] == b - a
        assert (
            record["acts"]["nbytes"] == len(shard) and record["acts"]["xxh3_128"] == xxhash.xxh3_128(shard).hexdigest()
        )
        column = (staging / part_file(k, "column.lengths")).read_bytes()
        assert column == lengths[a:b].tobytes()
        assert record["streams"]["column.lengths"] == {
            "nbytes": len(column),
            "xxh3_128": xxhash.xxh3_128(column).hexdigest(),
            "dtype": "<i4",
            "shape": [],
        }
        text = (staging / part_file(k, "text.prompt")).read_bytes()
        assert text == b"".join(orjson.dumps(p) + b"\n" for p in prompts[a:b])
        assert record["streams"]["text.prompt"] == {
            "nbytes": len(text),
            "xxh3_128": xxhash.xxh3_128(text).hexdigest(),
            "n_lines": b - a,
        }
    assert not (staging / part_record(0)).exists()


def test_stream_specs_say_what_a_part_record_holds() -> None:
    column = StreamSpec("column.token_ids", np.dtype("<i8"), (4,))
    assert column.to_json() == {"dtype": "<i8", "shape": [4]} == column.part_info(5)
    text = StreamSpec("text.prompt", None, ())
    assert text.is_text and text.to_json() == {} and text.part_info(5) == {"n_lines": 5}
    assert StreamSpec("acts", np.dtype("<f2"), (2, 5, 8)).part_info(5) == {}
