"""`benchmarks/dump.py`: its plain forward pass stops where the dump stops and covers what each
writer records, and its table's ratios are those of the figures measured (a benchmark that
compared the dump with more or less work than its own would be void)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks import dump as bench
from saev_shards import dump as dump_mod
from saev_shards.writer import rank_shards

from ..support.dumps import make_config


def test_the_forward_pass_runs_the_recorded_blocks_and_no_further(tmp_path: Path) -> None:
    the_plan = dump_mod.plan(make_config(tmp_path, n=23, layers=[1, 0]))
    forward = bench.Forward(the_plan)
    ran: list[int] = []
    blocks = forward.model.blocks
    handles = [b.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, b in enumerate(blocks)]
    try:
        forward.run(0, 23)
    finally:
        for h in handles:
            h.remove()
    batches = list(dump_mod.batches(0, 23, the_plan.metadata.examples_per_shard, the_plan.config.batch_size))
    assert len(blocks) == 4 and ran == [0, 1] * len(batches)  # blocks 2 and 3 never run, as in the dump


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_process_takes_the_examples_its_writer_records(tmp_path: Path, world: int) -> None:
    the_plan = dump_mod.plan(make_config(tmp_path, n=23), weights=False)
    md = the_plan.metadata
    spans = [bench.share(the_plan, rank, world) for rank in range(world)]
    assert [a for span in spans for a in range(*span)] == list(range(md.n_examples))
    for rank, (start, stop) in enumerate(spans):
        shards = rank_shards(md.n_shards, rank, world)
        assert start == shards.start * md.examples_per_shard
        assert stop == min(shards.stop * md.examples_per_shard, md.n_examples)


def test_the_table_divides_the_figures_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAEV_RESULTS_DIR", str(tmp_path))
    samples = {
        "forward": [(2.0, 4.0), (4.0, 4.0), (3.0, 4.0)],
        "float16": [(2.5, 4.4), (4.0, 4.4), (2.0, 4.4)],
        "float8_e4m3": [(4.0, 5.0), (4.0, 5.0), (4.0, 5.0)],
    }
    row = bench.Row("cpu", 1, samples, [1.0], {"float16": 100_000_000, "float8_e4m3": 50_000_000}, 1_000)
    table = bench.speed_table([row], rounds=3)
    forward, f16, f8 = table.rows
    assert forward[3:5] == ["forward alone", f"{1_000 * bench.TOKENS / 3.0:,.0f}"]  # the median round
    # Each round's forward over its dump: 2 / 2.5, 4 / 4, 3 / 2 -> median 1.00, from 0.80 to 1.50;
    # tokens/s and CPU from the median round (2.5 s, 4.4 s).
    assert f16[3:8] == ["float16", f"{64_000 / 2.5:,.0f}", "1.00", "0.80-1.50", "4.40"]
    # 2 / 4, 4 / 4, 3 / 4; 50 MB in 4 s against 1 GB/s, 2 digits.
    assert f8[5:11] == ["0.75", "0.50-1.00", "5.00", "1.25", "12.5", "0.013"]  # 50 MB in 4 s against 1 GB/s, 2 digits
