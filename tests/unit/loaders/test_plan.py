"""The plan of an epoch (pure numpy): shares, windows, segments, stacked rows; no torch needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.loaders.order import Sequential, ShuffledWindows
from saev_shards.loaders.plan import ReadSpans, index_window, plan_epoch
from saev_shards.loaders.selection import TokenSelection

from ...support import strategies
from ...support.loaders import cache

REPO = Path(__file__).resolve().parents[3]


@given(
    strategies.metadata(max_examples=30, min_examples=1),
    st.integers(1, 4),
    st.sampled_from([1, 50, 300, 1 << 20]),
    st.sampled_from([1, 64, 1 << 22]),
    st.booleans(),
    st.integers(1, 17),
)
def test_windows_and_segments_cover_each_share_once(
    md: ss.Metadata, world_size: int, window_rows: int, block_bytes: int, stack: bool, batch_size: int
) -> None:
    with cache(md) as (shards, _):
        selection = TokenSelection(shards)
        spans = ReadSpans(shards, selection, block_bytes, stack_layers=stack)
        assert spans.total == shards.n_examples * len(selection.base_tokens) * (1 if stack else md.n_layers)
        order = ShuffledWindows().block_order(len(spans), 3, 1)
        assert sorted(order.tolist()) == list(range(len(spans)))
        assert Sequential().block_order(len(spans), 3, 1).tolist() == list(range(len(spans)))
        rows: list[tuple[int, ...]] = []
        for rank in range(world_size):
            plan = plan_epoch(spans, order, rank, world_size, window_rows, batch_size, drop_last=False)
            assert sum(w.n_units for w in plan.windows) == plan.n_units == plan.window_start[-1]
            mine: list[tuple[int, ...]] = []
            for w in plan.windows:
                index = index_window(selection, spans, w, np.random.default_rng(w.index))
                assert len(index) == w.n_units
                flat = index.flat.reshape(len(index), -1)
                assert flat.shape[1] == (md.n_layers if stack else 1)
                mine += [
                    (int(e), int(t), *f.tolist()) for e, t, f in zip(index.examples, index.tokens, flat, strict=True)
                ]
            # The batches' segments tile [0, n_units) window by window, in order.
            pieces = [plan.segments(*plan.batch_range(b)) for b in range(plan.n_batches)]
            flat_pieces = [(w, a, b) for p in pieces for w, a, b in p]
            assert sum(b - a for _, a, b in flat_pieces) == plan.n_units
            assert all(0 <= a < b <= plan.windows[w].n_units for w, a, b in flat_pieces)
            rows += [(rank, e, t) for e, t, *_ in mine]
        keys = [(e, t) for _, e, t in rows]
        if stack:  # one row per (example, token)
            assert sorted(keys) == sorted(
                {(e, t) for e in range(md.n_examples) for t in selection.base_tokens.tolist()}
            )
        else:  # one row per (example, layer, token): each (example, token) once per layer
            assert sorted(keys) == sorted(
                (e, t) for e in range(md.n_examples) for _ in range(md.n_layers) for t in selection.base_tokens.tolist()
            )


@given(
    strategies.metadata(max_examples=30, min_examples=1),
    st.integers(1, 3),
    st.sampled_from([1, 7, 50, 300]),
    st.sampled_from([1, 3, 40, 1 << 20]),
    st.sampled_from([1, 64, 1 << 22]),
    st.integers(1, 17),
)
def test_a_smaller_first_window_cuts_the_same_stream(
    md: ss.Metadata, world_size: int, window_rows: int, first_rows: int, block_bytes: int, batch_size: int
) -> None:
    """An order whose windows are not permuted may read a smaller first window first: the same
    blocks in the same order, the first window holding the blocks that start before
    ``first_rows``, every later one ``window_rows`` of the stream from there."""
    with cache(md) as (shards, _):
        selection = TokenSelection(shards)
        spans = ReadSpans(shards, selection, block_bytes)
        order = Sequential().block_order(len(spans), 0, 0)
        for rank in range(world_size):
            even = plan_epoch(spans, order, rank, world_size, window_rows, batch_size, False)
            cut = plan_epoch(spans, order, rank, world_size, window_rows, batch_size, False, first_rows)
            assert [b for w in cut.windows for b in w.spans.tolist()] == [
                b for w in even.windows for b in w.spans.tolist()
            ]
            assert (cut.n_units, cut.n_batches) == (even.n_units, even.n_batches)
            assert sum(w.n_units for w in cut.windows) == cut.n_units == cut.window_start[-1]

            def units(plan: Any) -> list[tuple[int, int, int]]:
                out = []
                for w in plan.windows:
                    ix = index_window(selection, spans, w, None)
                    assert ix.layers is not None
                    out += list(zip(ix.examples.tolist(), ix.layers.tolist(), ix.tokens.tolist(), strict=True))
                return out

            assert units(cut) == units(even)  # the same units, in the same order
            # Each window holds the blocks of one bucket of the stream's rows, buckets increasing.
            first = min(first_rows, window_rows)
            sizes = [int(spans.rows[b]) for w in cut.windows for b in w.spans.tolist()]
            starts = np.cumsum([0, *sizes])[:-1].tolist()
            buckets: list[int] = []
            at = 0
            for w in cut.windows:
                mine = {0 if r < first else 1 + (r - first) // window_rows for r in starts[at : at + len(w.spans)]}
                at += len(w.spans)
                assert len(mine) == 1
                buckets += mine
            assert buckets == sorted(set(buckets)) and buckets[:1] == ([0] if cut.windows else [])


def test_planning_needs_no_torch(tmp_path: Path) -> None:
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from typing import Any
import saev_shards as ss, saev_shards.loaders, saev_shards.datasets
from saev_shards.loaders.plan import ReadSpans, plan_epoch, index_window
from saev_shards.loaders.selection import TokenSelection
from saev_shards.loaders.order import ShuffledWindows
from tests.support.caches import small_metadata, write_cache
md = small_metadata()
write_cache(Path({str(tmp_path)!r}), md, labels=True)
shards = ss.open(Path({str(tmp_path)!r}) / md.hash)
sel = TokenSelection(shards, ignore_labels=[1])
spans = ReadSpans(shards, sel, 100, stack_layers=True)
plan = plan_epoch(spans, ShuffledWindows().block_order(len(spans), 0, 0), 0, 1, 10, 7, False)
n = sum(len(index_window(sel, spans, w, None)) for w in plan.windows)
assert "torch" not in sys.modules
print("ok", n)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


def reference_index(
    selection: TokenSelection, spans: ReadSpans, window: Any, rng: np.random.Generator | None
) -> tuple[np.ndarray[Any, Any], ...]:
    """`index_window` written plainly: every unit listed in (example, layer, token) order, trimmed,
    permuted by gathering each column, then placed in the window buffer."""
    starts, stops = spans.start[window.spans], spans.stop[window.spans]
    sizes = stops - starts
    examples = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops, strict=True)])
    n_slots = 1 if spans.stack_layers else len(spans.slots)
    mask = selection.mask(examples, None)
    units = [
        (i, s, t)
        for i in range(int(sizes.sum()))
        for s in spans.slots[:n_slots].tolist()
        for t in np.flatnonzero(mask[i]).tolist()
    ]
    units = units[window.trim_lo : len(units) - window.trim_hi]
    if rng is not None:
        units = [units[j] for j in rng.permutation(len(units))]
    ex = np.array([u[0] for u in units], dtype=np.int64)
    slot = np.array([u[1] for u in units], dtype=np.int64)
    tok = np.array([u[2] for u in units], dtype=np.int64)
    T = selection.tokens_per_ex
    if spans.stack_layers:
        flat = (ex[:, None] * spans.rows_per_ex + spans.slots[None, :]) * T + tok[:, None]
    else:
        flat = (ex * spans.rows_per_ex + slot) * T + tok
    return flat, examples[ex], tok, spans.slot_layer[slot]


@given(
    strategies.metadata(max_examples=20, min_examples=1),
    st.integers(1, 3),
    st.sampled_from([1, 40, 1 << 20]),
    st.booleans(),
    st.sampled_from(["content", "all", "cls"]),
    st.booleans(),
    st.booleans(),
)
def test_index_window_matches_a_plain_listing(
    md: ss.Metadata, world_size: int, window_rows: int, stack: bool, tokens: str, one_layer: bool, shuffled: bool
) -> None:
    """The window index (computed from unit numbers, no gathers of unit-sized columns) is the
    plain listing's: the same units in the same order, so batches and resumed states stay the
    same as before it was rewritten."""
    if tokens == "cls" and not md.cls_token:
        tokens = "all"
    with cache(md) as (shards, _):
        layers = md.layers[-1] if one_layer else None
        selection = TokenSelection(shards, layers=layers, tokens=tokens)
        spans = ReadSpans(shards, selection, 64, stack_layers=stack)
        order = ShuffledWindows().block_order(len(spans), 5, 0)
        for rank in range(world_size):
            plan = plan_epoch(spans, order, rank, world_size, window_rows, 3, drop_last=False)
            for w in plan.windows:
                seed = [rank, w.index]
                index = index_window(selection, spans, w, np.random.default_rng(seed) if shuffled else None)
                flat, examples, toks, layers_col = reference_index(
                    selection, spans, w, np.random.default_rng(seed) if shuffled else None
                )
                np.testing.assert_array_equal(index.flat, flat)
                np.testing.assert_array_equal(index.examples, examples)
                np.testing.assert_array_equal(index.tokens, toks)
                if not stack:
                    np.testing.assert_array_equal(index.layers, layers_col)
