"""writer.space: which shards an earlier run sealed, and the bytes a writer still needs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards.fileio import bytes_on_disk
from saev_shards.writer.space import sealed_shards, space_needed

from ...support.caches import small_metadata


def test_sealed_shards_are_not_counted_again(root: Path) -> None:
    md = small_metadata(n_examples=13, dtype="float32")  # shards of 5, 5, 3
    columns = {"lengths": ("int32", ())}
    before = space_needed(md, root, columns=columns)
    assert sealed_shards(root, md) == []
    assert before == space_needed(md, root, columns=columns, restart=True)
    record = 2 * md.n_layers * md.d_model * 25
    per_shard = [bytes_on_disk([md.shard_nbytes(k), 0, record, md.shard_n_examples(k) * 4], root) for k in range(3)]
    assert before == bytes_on_disk([13 * 4], root) + sum(per_shard)  # the joined column, and every shard's files

    w = ss.ShardWriter(root, md, rank=1, world_size=2, durable=False, columns=columns)
    w.write(np.zeros((w.stop - w.start, *md.shape[1:]), np.float32), columns={"lengths": np.zeros(8, np.int32)})
    w.close()  # shards 1 and 2 sealed; shard 0 (rank 0's) missing
    assert sealed_shards(root, md) == [1, 2]
    assert space_needed(md, root, columns=columns) == before - per_shard[1] - per_shard[2]
    assert space_needed(md, root, columns=columns, restart=True) == before
    assert space_needed(md, root, 1, 2, columns=columns) == bytes_on_disk([13 * 4], root)  # rank 1 is done


def test_float8_scale_files_and_text_are_counted(root: Path) -> None:
    md = small_metadata(n_examples=10, dtype="float8_e4m3")
    plain = space_needed(md, root)
    scales = md.scales_nbytes // md.n_examples
    assert plain >= md.nbytes + 10 * scales
    with_text = space_needed(md, root, text=lambda a, b: [100 * (b - a)])
    assert with_text >= plain + 2 * 100 * 10  # the joined file and the parts
