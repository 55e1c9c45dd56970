"""reader.summary: the one-line repr of a cache and the table a notebook shows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards.reader.summary import describe, summary_html, summary_rows

from ...support.caches import small_metadata, write_cache


def test_the_repr_says_what_the_cache_is_and_where(root: Path) -> None:
    md = small_metadata()
    write_cache(root, md, labels=True, lengths=np.full(md.n_examples, 5, np.int32), text=True, stats=True)
    shards = ss.open(root / md.hash)
    line = describe(shards)
    assert line == repr(shards)
    assert line.startswith(
        f"<saev_shards.Shards {md.hash[:12]} clip:test/ckpt shape=(23, 2, 5, 8) float16 layers=[6, 11]"
    )
    assert " tokens=CLS + 4 shards=5x5 " in line and " protocol=3.1 " in line
    assert line.endswith(f" [labels, column lengths, text prompt, stats] at {shards.location}>")
    assert "(read as float32)" in describe(shards.with_dtype("float32"))


def test_the_notebook_table_has_one_row_per_fact(root: Path) -> None:
    md = small_metadata(sites=["encoder.3:input", "encoder.3:output"])
    write_cache(root, md)
    shards = ss.open(root / md.hash)
    rows = dict(summary_rows(shards))
    assert rows["cache"] == md.hash and rows["model"] == "clip test/ckpt"
    assert rows["shape"] == "(23, 2, 5, 8)  examples x layers x tokens x d_model"
    assert rows["layer 6"] == "encoder.3:input" and rows["layer 11"] == "encoder.3:output"
    assert rows["tokens"] == "5 per example (CLS + 4)" and rows["shards"] == "5 x 5 examples"
    assert rows["labels"] == rows["columns"] == rows["text"] == "-"
    assert rows["protocol"] == "3.2" and rows["location"] == shards.location
    html = summary_html(shards)
    assert md.hash[:12] in html and "encoder.3:output" in html and "shards.report()" in html
