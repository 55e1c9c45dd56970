"""What a notebook shows: a report, a `Shards` and a loader display themselves (IPython's
``_repr_html_`` / ``_repr_png_``), briefly, and say what a newcomer needs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss

from ..support.caches import small_metadata, write_cache

SITES = ("encoder.layer.3.intermediate:input", "encoder.layer.3.output.dense:output")


@pytest.fixture
def shards(tmp_path: Path) -> ss.Shards:
    md = small_metadata(layers=(0, 1), sites=SITES, d_model=8)
    write_cache(tmp_path, md, lengths=np.full(md.n_examples, 4, np.int32), stats=True)
    return ss.open(tmp_path / md.hash)


def cells(page: str) -> dict[str, str]:
    """The rows of a two-column table: name -> value."""
    return dict(re.findall(r"<tr><th[^>]*>(.*?)</th><td[^>]*>(.*?)</td></tr>", page))


def test_a_cache_shows_a_short_table(shards: ss.Shards) -> None:
    page = shards._repr_html_()
    rows = cells(page)
    md = shards.metadata
    assert rows["cache"] == md.hash and rows["shape"].startswith("(23, 2, 5, 8)")
    assert rows["layer 0"] == SITES[0] and rows["layer 1"] == SITES[1]  # what each slot holds
    assert rows["protocol"] == "3.2" and rows["stats"] == "stats.json"
    assert "shards.report() draws its picture" in page and len(page) < 4000
    assert "(2 sites)" in repr(shards)


def test_a_report_shows_its_picture_and_numbers_not_its_fields(shards: ss.Shards) -> None:
    pytest.importorskip("matplotlib")
    r = shards.report(progress=False)
    assert len(repr(r)) < 200 and repr(r).startswith(f"<CacheReport of {shards.metadata.hash[:12]}: median norms")
    assert r._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    page = r._repr_html_()
    assert page.startswith("<div>") and "<img src='data:image/png;base64," in page and "<!doctype" not in page
    assert "<td>intermediate (input)</td>" in page.replace("3.intermediate", "intermediate")  # the site, shortened
    assert r.labels == {0: "intermediate (input)", 1: "output.dense (output)"}
    assert "modules named after 'encoder.layer.3.'" in r.title


def test_a_loader_shows_what_it_yields(shards: ss.Shards) -> None:
    pytest.importorskip("torch")
    from saev_shards.loaders import OrderedLoader, ShuffledLoader

    with ShuffledLoader(shards, batch_size=16, sites=list(SITES), out_dtype="float32", seed=4) as loader:
        rows = cells(loader._repr_html_())
        assert rows["batches"] == "(16, 2, 8) float32"
        assert rows["sites"] == ", ".join(SITES)
        assert rows["order"] == "shuffled, seed 4"
        assert rows["per epoch"] == f"{len(loader)} batches, {loader.n_tokens:,} rows on rank 0 of 1"
        assert repr(loader).startswith("<saev_shards.ShuffledLoader (16, 2, 8) float32 x ")
    with OrderedLoader(shards, batch_size=8, layers=1, max_norm_multiple=50) as ordered:
        rows = cells(ordered._repr_html_())
        assert rows["layers"] == f"1 ({SITES[1]})" and rows["order"] == "(example, layer, token)"
        assert rows["max_norm_multiple"] == "50" and rows["batches"] == "(8, 8) float16"
