"""dump.model: how a dump names its model (``metadata.ckpt``), fingerprints its folder, and
reads the limits a module declares."""

from __future__ import annotations

from pathlib import Path

import pytest

from saev_shards.dump.config import ModelConfig
from saev_shards.dump.model import files_digest, folder_ckpt, model_dir, module_limits
from saev_shards.errors import ConfigError


def test_the_checkpoint_name_of_a_model_folder(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    assert folder_ckpt(snapshot) == "org/name"
    assert folder_ckpt(tmp_path / "minilm" / "model") == "minilm"
    assert folder_ckpt(tmp_path / "bert-tiny") == "bert-tiny"


def test_the_folder_digest_follows_the_model_files_only(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "weights.bin").write_bytes(b"\1\2\3")
    first = files_digest(tmp_path)
    (tmp_path / ".hidden").write_text("x")
    (tmp_path / "sub").mkdir()
    assert files_digest(tmp_path) == first
    (tmp_path / "weights.bin").write_bytes(b"\1\2\4")
    assert files_digest(tmp_path) != first
    with pytest.raises(ConfigError, match="holds no files"):
        files_digest(tmp_path / "sub")


def test_model_dir_of_each_kind_of_source(tmp_path: Path) -> None:
    assert model_dir(ModelConfig(path=str(tmp_path))) == tmp_path
    assert model_dir(ModelConfig(factory="m:f")) is None
    with pytest.raises(ConfigError, match=r"model\.package: cannot import 'no_such_package_here'"):
        model_dir(ModelConfig(package="no_such_package_here"))


def test_a_plain_module_declares_its_blocks_and_positions() -> None:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos_embed = torch.nn.Embedding(12, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    limits = module_limits(Tiny(), None)
    assert (limits.n_blocks, limits.max_positions, limits.d_model) == (3, 12, None)
    assert limits.keys[1] == "its position table 'pos_embed'"
