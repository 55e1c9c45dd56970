"""dump.config: a dump configuration parsed at the edge into frozen dataclasses, every problem
named at once."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from saev_shards.dump.config import DumpConfig, load_config, parse_config
from saev_shards.errors import ConfigError

BASE: dict[str, Any] = {"model": {"path": "/models/m"}, "layers": [1, 3], "T": 16}


def test_a_minimal_configuration_takes_the_defaults() -> None:
    cfg = parse_config(BASE)
    assert isinstance(cfg, DumpConfig)
    assert (cfg.model.path, cfg.layers, cfg.T, cfg.dtype, cfg.batch_size) == ("/models/m", (1, 3), 16, "float16", 32)
    assert cfg.dataset.kind == "stdlib" and cfg.sites == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.T = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(layers=[1, 1]), "config: layers: expected distinct block indices >= 0, e.g. [1, 3], found [1, 1]"),
        (dict(model={}), "config: model: give exactly one of path, package or factory, found none"),
        (dict(T=None), "config: missing key 'T'"),
        (
            dict(batch_size=0, colour=1),
            "config: unknown keys ['colour'] (allowed: ['T', 'allow_nonfinite', 'batch_size', 'budget', 'dataset', "
            "'device', 'dtype', 'layers', 'model', 'patches_per_shard', 'root', 'sites']); "
            "batch_size: expected an integer >= 1, found 0",
        ),
    ],
)
def test_every_problem_is_named(changes: dict[str, Any], message: str) -> None:
    obj = {k: v for k, v in {**BASE, **changes}.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        parse_config(obj)
    assert str(info.value) == message


def test_anything_but_a_table_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"config: expected an object \(table\), found str"):
        parse_config("x")


def test_a_toml_file_is_read_with_paths_relative_to_it(tmp_path: Path) -> None:
    path = tmp_path / "dump.toml"
    path.write_text('T = 8\nlayers = [2]\n[model]\npath = "model"\n')
    cfg = load_config(path)
    assert cfg.T == 8 and cfg.layers == (2,)
    assert Path(cfg.model.path or "") == tmp_path / "model"
