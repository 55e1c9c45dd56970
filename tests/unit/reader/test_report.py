"""`saev-shards report` / `Shards.report()`: the panels and their numbers, read back from
matplotlib's objects, against numpy over the logical tensor; one test renders the PNG."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.reader import report as report_mod

from ...support.caches import small_metadata

pytest.importorskip("matplotlib")

T, D = 5, 16


def dumped_like(root: Path, stats: bool) -> tuple[ss.Shards, dict[str, Any]]:
    """CLS + 4 tokens, lengths and true_lengths (3 of 12 truncated), dimension 3 of layer 11 massive."""
    md = small_metadata(n_examples=12, d_model=D, patches_per_shard=3 * T * 2)
    rng = np.random.default_rng(1)
    acts = rng.standard_normal(md.shape).astype(np.float32)
    acts[:, 1, :, 3] += 200.0  # a massive activation in one dimension
    acts[:, :, 0] *= 4  # the CLS token is bigger than the content
    lengths = np.array([5, 5, 3, 4, 5, 2, 5, 1, 5, 4, 5, 3], np.int32)
    true = lengths.copy()
    true[[0, 4, 8]] = [9, 7, 12]
    padding = np.arange(T)[None, :] >= lengths[:, None]  # (N, T)
    acts[np.broadcast_to(padding[:, None, :], acts.shape[:3])] = 0
    columns = {"lengths": ("int32", ()), "true_lengths": ("int32", ())}
    with ss.ShardWriter(root, md, durable=False, stats=stats, columns=columns) as w:
        w.write(acts, columns={"lengths": lengths, "true_lengths": true})
    shards = ss.open(root / md.hash)
    return shards, {"stored": shards.to_float32(shards[:]), "lengths": lengths, "true": true}


def panels(fig: Any) -> dict[str, Any]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


@pytest.mark.parametrize("stats", [True, False])
def test_the_panels_and_their_numbers(tmp_path: Path, stats: bool) -> None:
    shards, ref = dumped_like(tmp_path, stats)
    md = shards.metadata
    r = shards.report()
    by_title = panels(r.figure)
    assert set(by_title) == {
        "norms by layer",
        "dimensions, layer 6 (no outliers)",
        "dimensions, layer 11 (outliers: 3)",
        "CLS and content tokens",
        "lengths and truncation, 3 of 12 truncated to T=5",
    }  # four shards of one size: no panel of shard sizes, a line of the title says it
    assert r.outliers == {6: [], 11: [3]} and r.dims_source == ("stats.json" if stats else "this pass")
    # Norms: the population stats.json counts (positions below lengths), all drawn.
    x = ref["stored"]
    valid = np.arange(T)[None, :] < ref["lengths"][:, None]
    norms = np.sqrt((x * x).sum(axis=3, dtype=np.float32))
    norm_panel = by_title["norms by layer"]
    steps = [p for p in norm_panel.patches if type(p).__name__ == "StepPatch"]
    medians = [f"{r.median_norm(layer):.3g}" for layer in md.layers]
    assert [s.get_label() for s in steps] == [f"layer 6, median {medians[0]}", f"layer 11, median {medians[1]}"]
    for li, step in enumerate(steps):
        assert step.get_data().values.sum() == valid.sum() == r.norm_buckets[md.layers[li]].sum()
        median = np.sort(norms[:, li][valid])[(valid.sum() - 1) // 2]
        assert r.median_norm(md.layers[li]) <= median < r.median_norm(md.layers[li]) * 1.01  # its 0.8% bucket
    # Dimensions: mean and std per dimension as numpy gives them; the outlier marked.
    dims = by_title["dimensions, layer 11 (outliers: 3)"]
    mean_line, std_line, marks = dims.lines[:3]
    rows = x[:, 1][valid].astype(np.float64)
    np.testing.assert_allclose(mean_line.get_ydata(), rows.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std_line.get_ydata(), rows.std(axis=0), rtol=1e-4, atol=1e-5)
    assert list(marks.get_xdata()) == [3] and marks.get_label() == "outlier dimensions"
    # CLS and content apart: CLS norms are larger.
    assert r.median_norm(11, "cls") > r.median_norm(11, "content")
    assert r.cls_buckets[6].sum() == (ref["lengths"] > 0).sum()
    # Lengths: a histogram of kept lengths, one of true lengths, the truncation line at T.
    lengths_panel = by_title["lengths and truncation, 3 of 12 truncated to T=5"]
    kept = [p.get_height() for p in lengths_panel.patches if type(p).__name__ == "Rectangle"]
    assert sum(kept) == 12 and kept[5] == (ref["lengths"] == 5).sum()
    assert r.figure.get_suptitle().endswith(
        f"\n4 shards of {ss.humanize.human_bytes(shards.manifest.shards[0].nbytes)}"
    )
    # Every layer one colour in every panel; legends beside the axes, off the data.
    colour = {s.get_label().split(", ")[0]: s.get_edgecolor() for s in steps}
    cls_steps = [p for p in by_title["CLS and content tokens"].patches if type(p).__name__ == "StepPatch"]
    assert all(s.get_edgecolor() == colour[s.get_label().split(", ", 1)[1]] for s in cls_steps)
    for ax in by_title.values():
        legend = ax.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().x0 >= ax.get_window_extent().x1
    # The median of each layer is written on its line.
    assert [t.get_text() for t in norm_panel.texts] == medians


def test_shard_sizes_are_drawn_where_they_differ(tmp_path: Path) -> None:
    md = small_metadata(n_examples=13, d_model=D, patches_per_shard=3 * T * 2)  # 4 x 3 examples, then 1
    with ss.ShardWriter(tmp_path, md, durable=False) as w:
        w.write(np.ones(md.shape, np.float32))
    shards = ss.open(tmp_path / md.hash)
    r = shards.report(progress=False)
    bars = [p.get_height() for p in panels(r.figure)["shard sizes (5 shards)"].patches]
    assert bars == list(shards.manifest.shards.sizes) and len(set(bars)) == 2


def test_the_png_and_the_html_render(tmp_path: Path) -> None:
    shards, _ = dumped_like(tmp_path / "c", stats=True)
    shards.report(tmp_path / "r.png")
    png = tmp_path / "r.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    shards.report(tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page and "<td>11</td>" in page
    with pytest.raises(ss.ShardsError, match=r"ending in \.png or \.html"):
        shards.report(tmp_path / "r.pdf")


def test_the_command_writes_the_picture_and_prints_its_path_last(tmp_path: Path) -> None:
    shards, _ = dumped_like(tmp_path / "c", stats=False)
    out = tmp_path / "pic.png"
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards", "report", str(shards.path), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{out}\n" and out.read_bytes()[:4] == b"\x89PNG"
    assert "layer 11: median norm " in proc.stderr and "outlier dimensions: 3" in proc.stderr
    assert "truncated to T=5: 3 of 12 examples" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "saev_shards", "report", str(shards.path), "--out", str(tmp_path / "x.jpg")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "expected a file ending in .png or .html" in bad.stderr


def test_outlier_dimensions_rule() -> None:
    mean = np.array([0.0, 0.1, 50.0, -0.2])
    std = np.array([1.0, 1.0, 1.0, 1.2])
    assert report_mod.outlier_dimensions(mean, std) == [2]
    assert report_mod.outlier_dimensions(np.zeros(3), np.zeros(3)) == []


def _degenerate(root: Path, case: str) -> ss.Shards:
    """A cache the writer accepts, at an edge of what a picture can show."""
    cases: dict[str, dict[str, Any]] = {
        "all-zero": {},
        "all-NaN": {},
        "one example": {"n_examples": 1},
        "D = 1": {"d_model": 1},
        "empty": {"n_examples": 0},
        "one token, no CLS": {"patches_per_ex": 1, "cls_token": False, "layers": (0,)},
        "all-inf": {"dtype": "float32"},
        "one value": {},
    }
    changes = cases[case]
    md = small_metadata(**{"n_examples": 6, "patches_per_shard": 20, **changes})
    values = np.zeros(md.shape, np.float32)
    if case == "all-NaN":
        values[:] = np.nan
    elif case == "all-inf":
        values[:] = np.inf
    elif case == "one value":
        values[:] = 3.0
    elif case in ("one example", "D = 1", "one token, no CLS"):
        values = np.random.default_rng(0).standard_normal(md.shape).astype(np.float32)
    lengths = {"lengths": ("int32", ())}
    with ss.ShardWriter(root, md, durable=False, stats=True, allow_nonfinite=True, columns=lengths) as w:
        if md.n_examples:
            w.write(values, columns={"lengths": np.full(md.n_examples, md.tokens_per_ex, np.int32)})
    return ss.open(root / md.hash)


@pytest.mark.parametrize(
    "case", ["all-zero", "all-NaN", "all-inf", "one value", "one example", "D = 1", "empty", "one token, no CLS"]
)
def test_every_cache_the_writer_accepts_draws(tmp_path: Path, case: str) -> None:
    """Issue 29: a cache of zero vectors raised a raw ValueError from matplotlib. Every cache
    the writer accepts draws, as a PNG file and in a notebook, and says what it could not show."""
    shards = _degenerate(tmp_path / "c", case)
    r = shards.report(tmp_path / "r.png", progress=False)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert "<img src='data:image/png;base64," in r._repr_html_() and "<table" in r._repr_html_()
    norms = panels(r.figure)["norms by layer"]
    if case in ("all-NaN", "all-inf", "empty"):
        assert any("no finite vectors" in t.get_text() for t in norms.texts)
    if case in ("all-zero",):
        assert r.median_norm(shards.metadata.layers[0]) == 0.0
        assert any("zero" in t.get_text() for t in norms.texts)
