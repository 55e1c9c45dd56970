"""`dump`: a real forward pass into a cache; resume after SIGKILL; several writers; the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import dump as dump_mod
from saev_shards.cli import main as cli_main
from saev_shards.dump import batches, parse_config, plan, truncation
from saev_shards.errors import ConfigError
from saev_shards.humanize import human_bytes

from ..support.caches import tree_bytes
from ..support.dumps import LAYERS, T, make_config
from ..support.models import TinyTextModel, tiny_tokenize

REPO = Path(__file__).resolve().parents[2]


def quiet(_: str) -> None:
    pass


def test_dump_values_columns_stats_and_truncation(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    path = dump_mod.dump(cfg, durable=False, log=quiet)
    assert path is not None
    shards = ss.open(path)
    md = shards.metadata
    assert md.layers == tuple(LAYERS)
    assert (md.n_examples, md.tokens_per_ex, md.patches_per_ex, md.cls_token, md.d_model) == (23, T, T - 1, True, 16)
    assert md.n_shards == 5
    shards.verify()

    # The reference: tokenize, truncate and pad by hand; run every block directly.
    model = TinyTextModel(d_model=16, n_blocks=4, max_len=T).eval()
    full = tiny_tokenize([r["text"] for r in records])
    true = np.array([len(x) for x in full])
    lengths = np.minimum(true, T)
    ids = torch.zeros((len(full), T), dtype=torch.long)
    for i, x in enumerate(full):
        ids[i, : lengths[i]] = torch.tensor(x[:T])
    mask = (torch.arange(T)[None] < torch.as_tensor(lengths)[:, None]).long()
    # Batched exactly as the dump batches (a batch's other members can change the last bits).
    grid = list(batches(0, md.n_examples, md.examples_per_shard, cfg["batch_size"]))
    assert (0, 3) in grid and (3, 5) in grid  # cut at the shard end
    with torch.inference_mode():
        runs = [model(ids[a:b], mask[a:b], return_all=True) for a, b in grid]
    direct = [torch.cat([r[layer] for r in runs]) for layer in range(4)]
    for slot, layer in enumerate(LAYERS):
        want = direct[layer].to(torch.float16).numpy()
        want[np.arange(T)[None, :] >= lengths[:, None]] = 0  # padding is stored as zeros
        got = shards[:, slot]
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"layer {layer}"

    cols = shards.columns
    assert np.array_equal(cols["lengths"], lengths) and cols["lengths"].dtype == np.int32
    assert np.array_equal(cols["true_lengths"], true)
    assert np.array_equal(cols["token_ids"], ids.numpy())
    assert np.array_equal(cols["label"], [r["label"] for r in records]) and cols["label"].dtype == np.int64
    assert list(shards.text("id")) == [r["uid"] for r in records]
    assert list(shards.text("text")) == [r["text"] for r in records]
    assert list(shards.text("split")) == [r["split"] for r in records]

    t = truncation(shards)
    assert t["truncated_count"] == int((true > T).sum()) > 0
    assert t["truncated_fraction"] == pytest.approx((true > T).mean())
    assert t["dropped_tokens"] == int(np.maximum(true - T, 0).sum())
    assert 0 < t["truncated_count"] < md.n_examples  # the dataset has both kinds

    stats = shards.stats
    assert stats is not None
    for slot in range(len(LAYERS)):
        valid = np.concatenate([shards[i, slot, : lengths[i]].astype(np.float64) for i in range(md.n_examples)])
        assert stats["count"][slot] == lengths.sum()
        np.testing.assert_allclose(stats["mean"][slot], valid.mean(0), rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(stats["var"][slot], valid.var(0), rtol=1e-4)  # E[x²]-E[x]², float32 partial sums
        np.testing.assert_allclose(stats["norm_mean"][slot], np.linalg.norm(valid, axis=1).mean(), rtol=1e-6)
        assert stats["nonfinite"][slot] == 0

    # The same configuration again: already published, same path, nothing rewritten.
    assert dump_mod.dump(cfg, durable=False, log=quiet) == path


def test_a_float8_dump_is_the_float32_dump_quantized(tmp_path: Path) -> None:
    """``dtype = "float8_e4m3"``: the model's float32 activations quantized by the rule (on the
    model's device), padding stored as zero vectors, statistics of the dequantized values."""
    wide_path = dump_mod.dump(make_config(tmp_path, dtype="float32"), durable=False, log=quiet)
    path = dump_mod.dump(make_config(tmp_path, dtype="float8_e4m3"), durable=False, log=quiet)
    assert wide_path is not None and path is not None
    wide, shards = ss.open(wide_path), ss.open(path)
    assert (shards.metadata.dtype, shards.metadata.protocol) == ("float8_e4m3", ss.PROTOCOL)
    shards.verify()
    values, scales = ss.codecs.float8.quantize_numpy(wide[:])
    assert shards.scales is not None
    np.testing.assert_array_equal(shards.raw[:].view(np.uint8), values.view(np.uint8))
    np.testing.assert_array_equal(shards.scales[:], scales)
    lengths = shards.columns["lengths"]
    padding = np.arange(T)[None, :] >= lengths[:, None]  # (N, T)
    assert (shards.scales[:].transpose(0, 2, 1)[padding] == 0).all()  # zero vectors: scale 0
    got = shards.with_dtype("float32")[:]
    assert (np.abs(got - wide[:]) <= ss.codecs.float8.error_bound(wide[:], scales)).all()
    stats, wide_stats = shards.stats, wide.stats
    assert stats is not None and wide_stats is not None
    for slot in range(len(LAYERS)):
        valid = np.concatenate([got[i, slot, : lengths[i]].astype(np.float64) for i in range(len(got))])
        np.testing.assert_allclose(stats["mean"][slot], valid.mean(0), rtol=1e-5, atol=1e-7)
        assert stats["count"][slot] == wide_stats["count"][slot]


def test_hash_follows_every_setting_that_changes_bytes(tmp_path: Path) -> None:
    base = plan(make_config(tmp_path)).metadata.hash
    model = make_config(tmp_path)["model"]
    variants: list[dict[str, Any]] = [
        {"T": T + 1, "model": {**model, "kwargs": {"d_model": 16, "n_blocks": 4, "max_len": T + 1}}},
        {"batch_size": 4},
        {"budget": 10},
        {"dtype": "bfloat16"},
        {"layers": [1, 3]},
        {"model": {**model, "kwargs": {"d_model": 16, "n_blocks": 4, "max_len": T, "seed": 1}}},
        {"model": {**model, "weights_dtype": "bfloat16"}},
    ]
    hashes = {plan(make_config(tmp_path, **v)).metadata.hash for v in variants}
    assert base not in hashes and len(hashes) == len(variants)
    assert plan(make_config(tmp_path, root="elsewhere", device="cpu")).metadata.hash == base
    (tmp_path / "data.jsonl").write_text((tmp_path / "data.jsonl").read_text().replace("a", "b", 1))
    assert plan(make_config(tmp_path)).metadata.hash != base  # the corpus digest sees the text


def test_stdlib_corpus_dump(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, budget=7, dataset="stdlib")
    path = dump_mod.dump(cfg, durable=False, log=quiet)
    assert path is not None
    shards = ss.open(path)
    from saev_shards.dump.corpus import stdlib_corpus

    corpus = stdlib_corpus(7)
    assert shards.metadata.dataset == corpus.name
    assert shards.metadata.data["corpus"]["xxh3_128"] == corpus.digest
    assert list(shards.text("text")) == [ex.text for ex in corpus.examples]
    assert list(shards.text("id")) == [ex.id for ex in corpus.examples]


def test_lines_dataset_and_bfloat16_weights(tmp_path: Path) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text("first example\n\n  \nsecond, longer example here\nx\n")
    cfg = make_config(tmp_path, dataset={"kind": "lines", "path": str(lines), "min_chars": 2}, dtype="bfloat16")
    cfg["model"]["weights_dtype"] = "bfloat16"
    path = dump_mod.dump(cfg, durable=False, log=quiet)
    assert path is not None
    shards = ss.open(path)
    assert list(shards.text("text")) == ["first example", "second, longer example here"]
    assert list(shards.text("id")) == ["0", "3"]
    assert shards.metadata.data["model"]["weights_dtype"] == "bfloat16"
    assert shards.dtype == "bfloat16" and np.asarray(shards[:, 0]).any()


def test_config_errors_list_every_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "layers": [1, 1],
                "T": 0,
                "dtype": "int8",
                "surprise": 1,
                "model": {"path": "a", "factory": "b:c"},
                "dataset": {"kind": "csv", "columns": {"lengths": "int32"}},
                "batch_size": 0,
            }
        )
    msg = str(err.value)
    for part in (
        "unknown keys ['surprise']",
        "exactly one of path, package or factory",
        "dataset.kind",
        "reserved column name 'lengths'",
        "layers: expected distinct",
        "T: expected an integer >= 1",
        "dtype: expected one of",
        "batch_size: expected an integer >= 1",
    ):
        assert part in msg, part
    with pytest.raises(ConfigError, match="missing key 'model'"):
        parse_config({"layers": [0], "T": 4})
    cfg_file = tmp_path / "bad.toml"
    cfg_file.write_text("layers = [0\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        dump_mod.load_config(cfg_file)


def test_toml_and_json_configs_agree_and_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    toml = tmp_path / "sub" / "dump.toml"
    toml.write_text(
        'root = "out"\nlayers = [1]\nT = 8\n[model]\npath = "m"\n[dataset]\nkind = "lines"\npath = "x.txt"\n'
    )
    js = tmp_path / "sub" / "dump.json"
    js.write_text(json.dumps({"root": "out", "layers": [1], "T": 8, "model": "m", "dataset": "x.txt"}))
    a, b = dump_mod.load_config(toml), dump_mod.load_config(js)
    assert a == b
    assert a.root == str(tmp_path / "sub" / "out")
    assert a.model.path == str(tmp_path / "sub" / "m")
    assert a.dataset.path == str(tmp_path / "sub" / "x.txt")


@given(
    eps=st.integers(1, 20),
    batch=st.integers(1, 9),
    n_shards=st.integers(1, 6),
    data=st.data(),
)
def test_batches_follow_a_fixed_grid_inside_each_shard(eps: int, batch: int, n_shards: int, data: Any) -> None:
    n = data.draw(st.integers((n_shards - 1) * eps + 1, n_shards * eps))
    whole = list(batches(0, n, eps, batch))
    assert whole[0][0] == 0 and whole[-1][1] == n
    assert all(a < b and b - a <= batch and a // eps == (b - 1) // eps for a, b in whole)
    assert all(whole[i][1] == whole[i + 1][0] for i in range(len(whole) - 1))
    # Starting at any shard boundary (a resumed run, another rank) gives the same batches.
    k = data.draw(st.integers(0, n_shards - 1))
    stop_k = data.draw(st.integers(k + 1, n_shards))
    part = list(batches(k * eps, min(stop_k * eps, n), eps, batch))
    assert part == [ab for ab in whole if k * eps <= ab[0] < min(stop_k * eps, n)]


def test_dry_run_prints_hash_shards_and_bytes_and_writes_nothing(tmp_path: Path, capsys: Any) -> None:
    cfg = make_config(tmp_path)
    cfg_file = tmp_path / "dump.json"
    cfg_file.write_text(json.dumps(cfg))
    md = plan(cfg).metadata
    assert cli_main(["dump", str(cfg_file), "--dry-run", "--rank", "1", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert f"hash      {md.hash}" in out
    assert "shards    5 x 5 examples (last 3)" in out
    assert f"{human_bytes(md.nbytes)} activations" in out
    assert "rank 1 of 2: shards [2, 5), examples [10, 23)" in out
    assert "state     not started" in out
    assert not (tmp_path / "shards").exists()


def test_one_writer_of_many_says_how_many_shards_are_sealed(tmp_path: Path) -> None:
    """Writer 3 of 5 seals one shard of five: it says 1 of 5, and which shards are still to come."""
    cfg = make_config(tmp_path)  # 23 examples, 5 per shard: 5 shards, one per writer
    lines: list[str] = []
    assert dump_mod.dump(cfg, rank=3, world_size=5, durable=False, log=lines.append) is None
    assert lines[-1] == (
        "not published yet: 1 of 5 shards sealed; shards 0-2, 4 still to be written by the other writers "
        "(the last to finish publishes; or run again with --finalize)"
    )
    lines.clear()
    assert dump_mod.dump(cfg, rank=0, world_size=5, durable=False, log=lines.append) is None
    assert lines[-1].startswith("not published yet: 2 of 5 shards sealed; shards 1-2, 4 still to be written")
    assert dump_mod.shard_ranges([7]) == "shard 7" and dump_mod.shard_ranges([0, 1, 3, 5, 6, 7]) == "shards 0-1, 3, 5-7"


def test_no_finalize_then_finalize(tmp_path: Path, capsys: Any) -> None:
    cfg = make_config(tmp_path)
    md = plan(cfg).metadata
    root = Path(cfg["root"])
    for rank in (1, 0):
        assert dump_mod.dump(cfg, rank=rank, world_size=2, finalize_when_done=False, durable=False, log=quiet) is None
    assert not (root / md.hash).exists()
    cfg_file = tmp_path / "dump.json"
    cfg_file.write_text(json.dumps(cfg))
    assert cli_main(["dump", str(cfg_file), "--finalize"]) == 0
    assert f"published {root / md.hash}" in capsys.readouterr().out
    single = tmp_path / "single"
    dump_mod.dump(cfg, root=single, durable=False, log=quiet)
    assert tree_bytes(root / md.hash) == tree_bytes(single / md.hash)


# --------------------------------------------------------------------------------------
# separate processes: SIGKILL and resume; three writers


def _cli(cfg_file: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN"):
        if env is None or key not in env:
            full_env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, "-m", "saev_shards.dump", str(cfg_file), "--no-progress", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigkill_then_rerun_resumes_and_is_byte_identical(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, n=60)
    md = plan(cfg).metadata
    assert md.n_shards == 12
    cfg_file = tmp_path / "dump.json"
    cfg_file.write_text(json.dumps(cfg))
    staging = Path(cfg["root"]) / f".staging-{md.hash}"

    proc = _cli(cfg_file, env={"SAEV_TEST_DELAY": "0.15"})  # slow forward passes: time to kill it
    deadline = time.monotonic() + 120
    while not (staging / "part000002.json").exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the dump never sealed 3 shards"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    sealed = sorted(p.name for p in staging.glob("part*.json"))
    assert 3 <= len(sealed) < md.n_shards, sealed
    first = (staging / "acts000000.bin").stat()

    proc = _cli(cfg_file)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    resumed_at = int(out.split("resuming at example ")[1].split()[0])
    assert resumed_at >= 15 and resumed_at % 5 == 0, out
    published = Path(cfg["root"]) / md.hash
    assert (published / "acts000000.bin").stat().st_mtime_ns == first.st_mtime_ns  # not rewritten

    reference = tmp_path / "reference"
    dump_mod.dump(cfg, root=reference, log=quiet)
    assert tree_bytes(published) == tree_bytes(reference / md.hash)


def test_three_writer_processes_make_the_same_cache_as_one(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, n=40)
    md = plan(cfg).metadata
    cfg_file = tmp_path / "dump.json"
    cfg_file.write_text(json.dumps(cfg))
    procs = [
        _cli(cfg_file, "--rank", "0", "--world-size", "3"),
        _cli(cfg_file, env={"RANK": "1", "WORLD_SIZE": "3"}),  # torchrun's variables
        _cli(cfg_file, env={"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "5"}),
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    for rank, out in enumerate(outs):
        assert f"rank {rank} of 3: dumping" in out, out
    assert sum(f"published {Path(cfg['root']) / md.hash}" in out for out in outs) == 1, outs
    single = tmp_path / "single"
    dump_mod.dump(cfg, root=single, log=quiet)
    assert tree_bytes(Path(cfg["root"]) / md.hash) == tree_bytes(single / md.hash)


# -- sites (protocol 3.2): the input or output of any module --------------------------------


def test_a_dump_of_sites_records_each_module_input_and_output(tmp_path: Path) -> None:
    """``sites`` relative to each block of ``layers``: the slots are each block's sites, in
    order, named in full in ``metadata.sites``; the values are the recorder's for those
    modules, batched as the dump batches; a plain dump's hash is untouched by the feature."""
    plain = plan(make_config(tmp_path)).metadata
    assert plain.sites is None and plain.protocol == "3.1" and "sites" not in plain.data["dump"]
    cfg = make_config(
        tmp_path,
        layers=[3, 1],
        sites=["mlp:input", "mlp:output", ":output"],
        dtype="float32",
        patches_per_shard=5 * T * 6,  # 5 examples per shard, as the plain dump: the same batches
    )
    path = dump_mod.dump(cfg, durable=False, log=quiet)
    assert path is not None
    shards = ss.open(path)
    md = shards.metadata
    assert (md.protocol, md.layers, md.d_model) == ("3.2", (0, 1, 2, 3, 4, 5), 16)
    assert [str(s) for s in md.sites or ()] == [
        "blocks.3.mlp:input", "blocks.3.mlp:output", "blocks.3:output",
        "blocks.1.mlp:input", "blocks.1.mlp:output", "blocks.1:output",
    ]  # fmt: skip
    assert md.data["dump"]["sites"] == ["mlp:input", "mlp:output", ":output"]
    shards.verify()
    block_outputs = ss.open(dump_mod.dump(make_config(tmp_path, dtype="float32"), durable=False, log=quiet) or "")
    np.testing.assert_array_equal(shards[:, 2], block_outputs[:, 0])  # blocks.3:output is layer 3
    np.testing.assert_array_equal(shards[:, 5], block_outputs[:, 1])
    model = TinyTextModel(d_model=16, n_blocks=4, max_len=T).eval()
    lengths = shards.columns["lengths"]
    from saev_shards.dump.recorder import Recorder

    enc = dump_mod.TextEncoder(tiny_tokenize, T)
    records = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    rec = Recorder(model, dict(zip(md.layers, md.sites or (), strict=True)), dtype="float32")
    for a, b in batches(0, md.n_examples, md.examples_per_shard, cfg["batch_size"]):
        e = enc.encode([r["text"] for r in records[a:b]])
        want = rec.record(**e.inputs, lengths=torch.as_tensor(e.lengths)).numpy()
        np.testing.assert_array_equal(shards[a:b], want)
    padding = np.arange(T)[None, :] >= lengths[:, None]  # (N, T)
    assert (shards[:].transpose(0, 2, 1, 3)[padding] == 0).all()  # every site's padding: zeros


def test_sites_with_full_names_and_a_pair_for_a_transcoder(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, sites=["blocks.2.mlp:input", "blocks.2.mlp:output"])
    del cfg["layers"]
    the_plan = plan(cfg)
    md = the_plan.metadata
    assert [str(s) for s in md.sites or ()] == ["blocks.2.mlp:input", "blocks.2.mlp:output"]
    assert "2 sites (layer: module:io) 0: blocks.2.mlp:input, 1: blocks.2.mlp:output" in dump_mod.describe(
        the_plan, tmp_path, 0, 1
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sites": ["mlp:inside"]}, r"sites\[0\]: expected 'module:input' or 'module:output'"),
        ({"sites": ["mlp:input", "mlp:input"]}, r"sites: each site once, found \['mlp:input'\]"),
        ({"sites": "mlp:input"}, "sites: expected a list of sites"),
        ({"sites": [3]}, r"sites\[0\]: expected a site"),
    ],
)
def test_bad_sites_in_a_config_are_named(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(make_config(tmp_path, **changes))


def test_sites_the_model_cannot_give_are_config_errors_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"sites: layer 0: no module named 'blocks\.3\.mpl'"):
        plan(make_config(tmp_path, sites=["mpl:input"]))
    with pytest.raises(
        ConfigError, match=r"sites: blocks\.\d\.mlp\.0: output shape .* differs from the other recorded sites"
    ):
        plan(make_config(tmp_path, sites=["mlp:input", "mlp.0:output"]))  # 16 and 32 wide
    cfg = make_config(tmp_path)
    del cfg["layers"]
    with pytest.raises(ConfigError, match=r"missing key 'layers' \(block indices; or sites"):
        parse_config(cfg)
    assert not (tmp_path / "shards").exists()
