"""shuffle.source: the source columns with one value per token position, carried into the
shuffled cache beside each chosen token."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards.shuffle.source import per_token_columns

from ...support.caches import small_metadata


def test_only_columns_of_one_value_per_token_position_are_carried(root: Path) -> None:
    md = small_metadata(n_examples=4)  # 5 tokens per example
    columns = {"lengths": ("int32", ()), "token_ids": ("int64", (5,)), "window": ("int16", (4,))}
    with ss.ShardWriter(root, md, durable=False, columns=columns) as w:
        w.write(
            np.zeros(md.shape, np.float32),
            columns={
                "lengths": np.full(4, 5, np.int32),
                "token_ids": np.zeros((4, 5), np.int64),
                "window": np.zeros((4, 4), np.int16),
            },
        )
    assert per_token_columns(ss.open(root / md.hash)) == {"token_ids": np.dtype("<i8")}
