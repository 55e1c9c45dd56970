"""Run folders (seed 004): ``<runs root>/<run_id>/`` with ``links/``, ``checkpoint/`` and ``inference/``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from pathlib import Path

from .. import reader
from ..errors import (
    RootNotSetError,
    RunError,
    RunExistsError,
    RunNotFoundError,
)
from .roots import PathLike, Roots, resolve, runs_root

# --------------------------------------------------------------------------------------
# runs

#: The links a run folder holds (seed 004): the caches and the datasets they came from.
LINK_NAMES = ("train-shards", "train-dataset", "val-shards", "val-dataset")
#: The seed's resolution example calls the training links ``shards`` and ``dataset``.
LINK_ALIASES = {"train-shards": "shards", "train-dataset": "dataset"}
#: What training writes into ``checkpoint/``.
CHECKPOINT_FILES = ("sae.pt", "config.json")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run folder; every other path is resolved from it (seed 004, ``--run <path>``).

    >>> run = open_run("/nfs/saev/runs/sae-16k")   # doctest: +SKIP
    >>> run.train_shards                          # doctest: +SKIP
    PosixPath('/scratch/saev/shards/3f2a...')
    """

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def links_dir(self) -> Path:
        return self.path / "links"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def sae_checkpoint(self) -> Path:
        """``checkpoint/sae.pt``."""
        return self.checkpoint_dir / "sae.pt"

    @property
    def checkpoint_config(self) -> Path:
        """``checkpoint/config.json``."""
        return self.checkpoint_dir / "config.json"

    def inference_dir(self, shard_hash: str) -> Path:
        """``inference/<shard_hash>/``: outputs of running the trained SAE over a cache."""
        return self.path / "inference" / shard_hash

    def link(self, name: str) -> Path:
        """The link ``links/<name>`` itself (the seed's older alias when only that exists)."""
        if name not in LINK_NAMES:
            raise KeyError(f"unknown link {name!r}; a run has {list(LINK_NAMES)}")
        path = self.links_dir / name
        alias = LINK_ALIASES.get(name)
        if alias is not None and not os.path.lexists(path) and os.path.lexists(self.links_dir / alias):
            return self.links_dir / alias
        return path

    def target(self, name: str) -> Path:
        """Where ``links/<name>`` points, fully resolved; `RunError` if missing or dangling."""
        link = self.link(name)
        if not os.path.lexists(link):
            raise RunError(f"{link}: missing; expected a symlink (create runs with: saev-shards run init)")
        if not link.exists():
            raise RunError(f"{link}: dangling link to {os.readlink(link)} (the target does not exist)")
        return link.resolve()

    @property
    def train_shards(self) -> Path:
        return self.target("train-shards")

    @property
    def val_shards(self) -> Path:
        return self.target("val-shards")

    @property
    def train_dataset(self) -> Path:
        return self.target("train-dataset")

    @property
    def val_dataset(self) -> Path:
        return self.target("val-dataset")

    def open_train(self) -> reader.Shards:
        """Open the training cache (``links/train-shards``)."""
        return reader.open(self.train_shards)

    def open_val(self) -> reader.Shards:
        """Open the validation cache (``links/val-shards``)."""
        return reader.open(self.val_shards)


def open_run(run: PathLike, runs_root: PathLike | None = None) -> Run:
    """The run at path ``run``, or, for a bare name that is not a path, ``<runs root>/<run>``."""
    text = os.fspath(run)
    path = Path(text).expanduser()
    if path.is_dir():
        return Run(path.absolute())
    if path.exists():
        raise RunError(f"{path.absolute()}: expected a run folder, found a file")
    tried = [str(path.absolute())]
    if os.sep not in text and _RUN_ID_RE.fullmatch(text):
        with contextlib.suppress(RootNotSetError):  # a bare name that is not a path, and no root
            candidate = _runs_root_path(runs_root) / text
            if candidate.is_dir():
                return Run(candidate)
            tried.append(str(candidate))
    raise RunNotFoundError(f"no run folder at {' nor '.join(tried)}")


def _runs_root_path(root: PathLike | None) -> Path:
    # `create_run` and `open_run` take an argument named like `runs_root`; this reaches it.
    return runs_root(root).path


def create_run(
    train: PathLike,
    val: PathLike | None = None,
    *,
    run_id: str | None = None,
    runs_root: PathLike | None = None,
    roots: Roots = None,
    train_dataset: PathLike | None = None,
    val_dataset: PathLike | None = None,
) -> Run:
    """Create ``<runs root>/<run_id>/`` with ``checkpoint/`` and the ``links/`` of seed 004.

    ``train`` and ``val`` are cache references (paths, hashes or prefixes); each must open.
    The dataset links default to the ``dataset`` recorded in each cache's metadata and
    are created even when that path does not exist here (`doctor` reports them).
    ``run_id`` defaults to ``<YYYYmmdd-HHMMSS>-<train hash[:8]>``.
    """
    train_cache = reader.open(resolve(train, roots))
    val_cache = reader.open(resolve(val, roots)) if val is not None else None
    base = _runs_root_path(runs_root)
    if run_id is None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{train_cache.path.name[:8]}"
    if not _RUN_ID_RE.fullmatch(run_id):
        raise RunError(f"bad run id {run_id!r}: expected letters, digits and ._+=@- (no '/', not starting with '.')")
    targets: dict[str, Path] = {"train-shards": train_cache.path}
    dataset = train_dataset if train_dataset is not None else train_cache.metadata.dataset or None
    if dataset is not None:
        targets["train-dataset"] = Path(dataset).expanduser().absolute()
    if val_cache is not None:
        targets["val-shards"] = val_cache.path
        dataset = val_dataset if val_dataset is not None else val_cache.metadata.dataset or None
        if dataset is not None:
            targets["val-dataset"] = Path(dataset).expanduser().absolute()
    elif val_dataset is not None:
        targets["val-dataset"] = Path(val_dataset).expanduser().absolute()
    base.mkdir(parents=True, exist_ok=True)
    path = base / run_id
    try:
        os.mkdir(path)  # claims the id atomically: two creators cannot share a run
    except FileExistsError:
        raise RunExistsError(f"{path}: a run with this id already exists") from None
    (path / "links").mkdir()
    (path / "checkpoint").mkdir()
    for name, target in targets.items():
        os.symlink(target, path / "links" / name)
    return Run(path)
