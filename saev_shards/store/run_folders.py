"""SAE training run folders: ``<runs root>/<run_id>/`` with ``links/``, ``checkpoint/`` and ``inference/``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
import warnings
from pathlib import Path

from .. import reader
from ..errors import (
    RootNotSetError,
    RunError,
    RunExistsError,
    RunNotFoundError,
    RunWarning,
    ShardsError,
)
from ..protocol.common import MAX_METADATA_BYTES, METADATA_FILE
from ..protocol.jsonfile import read_json_file
from ..protocol.metadata import Metadata, parse_metadata
from .roots import PathLike, Roots, _scan, resolve, runs_root

#: The links a run folder holds (saev's run layout): the caches and the datasets they came from.
LINK_NAMES = ("train-shards", "train-dataset", "val-shards", "val-dataset")
#: saev's own run layout calls the training links ``shards`` and ``dataset``.
LINK_ALIASES = {"train-shards": "shards", "train-dataset": "dataset"}
#: What training writes into ``checkpoint/``.
CHECKPOINT_FILES = ("sae.pt", "config.json")
#: The folders of a run; saev's own ``Run`` refuses a run folder without every one of them.
RUN_DIRS = ("links", "checkpoint", "inference")
#: What a training run relies on being the same in its train and val caches.
MUST_AGREE = ("family", "ckpt", "layers", "d_model", "tokens_per_ex", "dtype")
_RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")


@dataclasses.dataclass(frozen=True)
class Run:
    """A run folder; every other path is resolved from it (saev's ``--run <path>``).

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

    @property
    def inference_root(self) -> Path:
        """``inference/``: where outputs of the trained SAE go (one folder per cache)."""
        return self.path / "inference"

    def inference_dir(self, shard_hash: str) -> Path:
        """``inference/<shard_hash>/``: outputs of running the trained SAE over a cache."""
        return self.inference_root / shard_hash

    def link(self, name: str) -> Path:
        """The link ``links/<name>`` itself (saev's older alias when only that exists)."""
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
            why = ""
            if name.endswith("-dataset"):
                with contextlib.suppress(RunError, ShardsError, OSError):
                    md = self.target(name.replace("-dataset", "-shards")).joinpath(METADATA_FILE)
                    _, reason = dataset_target(parse_metadata(read_json_file(md, MAX_METADATA_BYTES)))
                    why = f" ({reason}; training needs only the shards)" if reason else ""
            hint = f"run init --{name} PATH" if name.endswith("-dataset") else "run init"
            raise RunError(f"{link}: missing{why}; expected a symlink (create it with: saev-shards {hint})")
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


def runs_linking(cache: PathLike, runs_root: PathLike | None = None) -> list[tuple[Run, str]]:
    """``(run, link name)`` for every link under ``<runs root>/*/links/`` that resolves to
    ``cache``: the runs that would break if it were removed (`RootNotSetError` when no
    runs root is configured)."""
    target = Path(cache).resolve()
    base = _runs_root_path(runs_root)
    found: list[tuple[Run, str]] = []
    for run_dir in sorted(_scan(base), key=lambda e: e.name):
        links = Path(run_dir.path) / "links"
        if not run_dir.is_dir(follow_symlinks=False) or not links.is_dir():
            continue
        found.extend(
            (Run(Path(run_dir.path)), link.name)
            for link in sorted(_scan(links), key=lambda e: e.name)
            if link.is_symlink() and Path(link.path).resolve() == target
        )
    return found


def dataset_target(md: Metadata) -> tuple[Path | None, str]:
    """Where a run's dataset link points by default for a cache with metadata ``md``.

    ``metadata.dataset`` is "an absolute path, or a name" (protocol.md 2.1): an absolute
    path that exists here is linked; a name (``python-stdlib-3.11.7``, ``imagenet-1k``), an
    empty value or a path absent from this machine is not. Returns ``(path, "")``, or
    ``(None, why)`` saying why nothing is linked.
    """
    value = md.dataset
    if not value:
        return None, "the cache records no dataset"
    path = Path(value)
    if not path.is_absolute():
        return None, f"the cache's dataset {value!r} is a name, not a path"
    if not path.exists():
        return None, f"the cache's dataset {value} does not exist here"
    return path, ""


def compare_caches(train: Metadata, val: Metadata) -> list[str]:
    """What a training run relies on that ``val`` does not share with ``train`` (empty when
    they agree): the same cache twice, another model, layers, width, tokens or dtype."""
    if train.hash == val.hash:
        return ["the val cache is the train cache"]
    differ = [
        f"{k} {getattr(train, k)!r} vs {getattr(val, k)!r}" for k in MUST_AGREE if getattr(train, k) != getattr(val, k)
    ]
    return ["train and val caches differ: " + "; ".join(differ)] if differ else []


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
    """Create ``<runs root>/<run_id>/`` with ``links/``, ``checkpoint/`` and ``inference/`` (saev's
    own ``Run`` opens it).

    ``train`` and ``val`` are cache references (paths, hashes or prefixes); each must open.
    A val cache that is the train cache, or differs in what training relies on
    (`compare_caches`), is a `RunWarning` here, not only at `doctor`. The dataset links
    point where ``train_dataset`` / ``val_dataset`` say (even if absent here), else where
    the cache's metadata says when that is a path that exists here (`dataset_target`); a
    cache whose dataset is a name gets no dataset link. ``run_id`` defaults to
    ``<YYYYmmdd-HHMMSS>-<train hash[:8]>``.
    """
    train_cache = reader.open(resolve(train, roots))
    val_cache = reader.open(resolve(val, roots)) if val is not None else None
    base = _runs_root_path(runs_root)
    if run_id is None:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{train_cache.path.name[:8]}"
    if not _RUN_ID_RE.fullmatch(run_id):
        raise RunError(f"bad run id {run_id!r}: expected letters, digits and ._+=@- (no '/', not starting with '.')")
    targets: dict[str, Path] = {"train-shards": train_cache.path}
    for split, cache, given in (("train", train_cache, train_dataset), ("val", val_cache, val_dataset)):
        if cache is not None and split == "val":
            targets["val-shards"] = cache.path
        target = Path(given).expanduser().absolute() if given is not None else None
        if target is None and cache is not None:
            target = dataset_target(cache.metadata)[0]
        if target is not None:
            targets[f"{split}-dataset"] = target
    if val_cache is not None:
        for problem in compare_caches(train_cache.metadata, val_cache.metadata):
            warnings.warn(RunWarning(f"--val {val_cache.path.name[:12]}: {problem}"), stacklevel=2)
    base.mkdir(parents=True, exist_ok=True)
    path = base / run_id
    try:
        os.mkdir(path)  # claims the id atomically: two creators cannot share a run
    except FileExistsError:
        raise RunExistsError(f"{path}: a run with this id already exists") from None
    for folder in RUN_DIRS:
        (path / folder).mkdir()
    for name, target in targets.items():
        os.symlink(target, path / "links" / name)
    return Run(path)
