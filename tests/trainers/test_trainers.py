"""docs/training.md's recipes against the real trainers from PyPI: SAELens, dictionary_learning,
EleutherAI's sparsify and overcomplete, each trained a few hundred steps from a cache.

They run in `.venv-trainers` (`make test-trainers`, part of `make test-all`), which holds the
trainers beside this package and the same torch 2.13.0 (constraints.txt); in an environment
without a trainer its test is skipped. Each test runs the page's batches block, then the
trainer's block, both as written (the hash prefix replaced by the cache's path), and checks
that the fraction of variance unexplained on a held-out batch fell: the cache's vectors are
sparse sums of a hidden dictionary, which a sparse autoencoder learns quickly.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss

from ..integration.test_docs_snippets import REPO, blocks

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

DOC = "docs/training.md"


def doc_block(marker: str) -> str:
    """The one Python block of docs/training.md holding ``marker``."""
    found = [source for where, source in blocks() if where.startswith(f"{DOC}:") and marker in source]
    assert len(found) == 1, f"{DOC}: {len(found)} blocks hold {marker!r}"
    return found[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> ss.Shards:
    """Layers 3 and 11 of 400 examples x 16 tokens x 16 dimensions, every vector a sum of 3 of
    64 hidden directions with random positive weights (plus a little noise), and statistics."""
    root = tmp_path_factory.mktemp("trainers")
    n, tokens, d, atoms = 400, 16, 16, 64
    md = ss.Metadata(family="synthetic", ckpt="sparse-sums", layers=(3, 11), patches_per_ex=tokens - 1,
                     cls_token=True, d_model=d, n_examples=n, patches_per_shard=n * tokens,
                     data={"name": "sparse sums of 64 directions"}, dataset="synthetic")  # fmt: skip
    rng = np.random.default_rng(0)
    dictionary = rng.standard_normal((2, atoms, d)).astype(np.float32)
    dictionary /= np.linalg.norm(dictionary, axis=-1, keepdims=True)
    codes = np.zeros((n, 2, tokens, atoms), np.float32)
    chosen = np.argsort(rng.random((n, 2, tokens, atoms)), axis=-1)[..., :3]
    np.put_along_axis(codes, chosen, rng.exponential(2.0, chosen.shape).astype(np.float32), axis=-1)
    acts = np.einsum("nltf,lfd->nltd", codes, dictionary) + 0.05 * rng.standard_normal((n, 2, tokens, d))
    with ss.ShardWriter(root, md, durable=False, stats=True) as w:
        w.write(acts.astype(np.float32) + 1.0)  # an offset, which the recipes' centring removes
    return ss.open(root / md.hash)


def run_recipe(cache: ss.Shards, marker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The batches block, then the block holding ``marker``, in one namespace, in ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    prelude = doc_block("def activations(loader").replace('"3f2a"', repr(str(cache.path)))
    exec(compile(prelude, f"{DOC} (batches)", "exec"), namespace)  # the docs' own code
    exec(compile(doc_block(marker), f"{DOC} ({marker})", "exec"), namespace)
    return namespace


def assert_loss_fell(namespace: dict[str, Any]) -> None:
    before, after = namespace["before"], namespace["after"]
    assert np.isfinite(after) and after < 0.5 * before, (before, after)


def test_saelens_sae_trainer_from_the_loader(cache: ss.Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sae_lens")
    namespace = run_recipe(cache, "from sae_lens import", tmp_path, monkeypatch)
    assert namespace["trainer"].n_training_steps == 300
    assert_loss_fell(namespace)


def test_dictionary_learning_train_sae_from_the_loader(
    cache: ss.Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("dictionary_learning")
    namespace = run_recipe(cache, "from dictionary_learning", tmp_path, monkeypatch)
    assert (tmp_path / "dictionary-learning-run" / "trainer_0" / "ae.pt").is_file()
    assert_loss_fell(namespace)


def test_sparsify_sparse_coder_from_the_loader(
    cache: ss.Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sparsify.sparse_coder")  # EleutherAI's (eai-sparsify), not Neural Magic's
    namespace = run_recipe(cache, "from sparsify import", tmp_path, monkeypatch)
    assert_loss_fell(namespace)


@pytest.fixture
def overcomplete_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What `import overcomplete` (0.3.0) needs outside its SAE code (docs/training.md,
    overcomplete): an empty torchvision where none is installed (PyPI's does not load beside
    the CPU torch 2.13.0 here), and ``matplotlib.cm.get_cmap``, removed in matplotlib 3.9
    (``matplotlib.colormaps.get_cmap`` replaces it). The SAE code that runs is its own."""
    try:
        importlib.import_module("torchvision")
    except ImportError:
        stub, transforms = types.ModuleType("torchvision"), types.ModuleType("torchvision.transforms")
        stub.__dict__["transforms"] = transforms
        monkeypatch.setitem(sys.modules, "torchvision", stub)
        monkeypatch.setitem(sys.modules, "torchvision.transforms", transforms)
    import matplotlib
    import matplotlib.cm

    if not hasattr(matplotlib.cm, "get_cmap"):
        monkeypatch.setattr(matplotlib.cm, "get_cmap", matplotlib.colormaps.get_cmap, raising=False)
    yield


def test_overcomplete_train_sae_from_the_loader(
    cache: ss.Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overcomplete_importable: None
) -> None:
    pytest.importorskip("overcomplete")
    namespace = run_recipe(cache, "from overcomplete.sae import", tmp_path, monkeypatch)
    logs = namespace["logs"]["avg_loss"]
    assert len(logs) == 25 and logs[-1] < 0.5 * logs[0], logs
    assert_loss_fell(namespace)


def test_every_trainer_block_is_run_here() -> None:
    """A new trainer's block on the page gets a test here (the others run in make test)."""
    markers = ["from sae_lens import", "from dictionary_learning", "from sparsify import", "from overcomplete.sae"]
    here = ["def activations(loader", "def train(steps, checkpoint", "class Crosscoder(", *markers]
    here += [
        "exclude_token_ids=[101, 102, 0],",
        'ss.open(dump("transcoder.toml"))',
    ]  # run by make test, test_transcoder
    sources = [source for where, source in blocks() if where.startswith(f"{DOC}:")]
    assert sorted(sum(m in s for m in here) for s in sources) == [1] * len(sources), "a block not planned"
    assert (REPO / DOC).is_file()
