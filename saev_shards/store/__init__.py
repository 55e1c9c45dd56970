"""The shard store, a catalogue of roots: where caches and runs live, how a hash names a
cache, copies of caches, run folders.

* `roots`: the shards, runs and stage roots, and `resolve` (a path, a full hash or a
  unique prefix -> one cache); `open_cache` (`saev_shards.open`) resolves, then opens;
* `caches`: what a root holds: `list_caches`, `unpublished` (staging and copying folders
  with size, age and whether their writer is alive), `remove`, `remove_unpublished`;
* `info`: `summary`, what ``saev-shards info`` shows about a cache;
* `sidecar`: statistics computed for an existing cache, kept in ``<root>/.stats/`` and
  found by `Shards.stats` (`compute_stats`, `write_sidecar`, `find_stats`);
* `copies`: verified, atomic, resumable copies: `stage` / `copy_cache` / `pull` into a
  local folder, `push` into a remote root (`CopyOptions`, `TransferReport`; the bytes move
  through `storage.transfer`);
* `remote_roots`: shards roots in object stores: `list_remote`, `resolve_remote`,
  `find_cache` (a URL, a local reference, or a hash found in a remote root), `remove_remote`,
  `nested_roots` (roots below a bucket's top);
* `run_folders`: SAE training run folders (`create_run`, `open_run`, `Run`);
* `doctor`: what is wrong with a run (`doctor`) or with the configured roots
  (`doctor_environment`).

>>> path = resolve("3f2a")              # doctest: +SKIP  (a unique prefix, like git)
>>> shards = stage("3f2a")              # doctest: +SKIP  (verified local copy, opened)
>>> run = create_run("3f2a", "9c1d", run_id="sae-16k")   # doctest: +SKIP
>>> run.train_shards, run.sae_checkpoint                 # doctest: +SKIP
"""

from __future__ import annotations

from ..storage.transfer import TransferReport
from .caches import (
    KIND_NAMES,
    CacheEntry,
    Unpublished,
    check_not_in_use,
    folder_nbytes,
    is_live,
    list_caches,
    list_unpublished,
    open_cache,
    open_quietly,
    remove,
    remove_unpublished,
    unpublished,
)
from .copies import CopyOptions, PushReport, StageReport, copy_cache, pull, push, stage
from .doctor import Finding, doctor, doctor_environment
from .info import summary
from .inuse import Holder, users
from .remote_roots import (
    RemoteEntry,
    find_cache,
    list_remote,
    locate,
    nested_roots,
    remote_objects,
    remove_remote,
    resolve_remote,
)
from .roots import (
    COPY_PREFIX,
    MIN_PREFIX,
    NFS_ENV,
    RUNS_ROOT_ENV,
    SCRATCH_ENV,
    SHARDS_ROOT_ENV,
    STAGE_ROOT_ENV,
    PathLike,
    Root,
    Roots,
    check_reference,
    local_roots,
    remote_roots,
    resolve,
    runs_root,
    shards_root,
    shards_roots,
    stage_root,
)
from .run_folders import (
    CHECKPOINT_FILES,
    LINK_ALIASES,
    LINK_NAMES,
    MUST_AGREE,
    RUN_DIRS,
    Run,
    compare_caches,
    create_run,
    dataset_target,
    open_run,
    runs_linking,
)
from .sidecar import SIDECAR_DIR, compute_stats, find_stats, sidecar_path, write_sidecar

__all__ = [
    "CHECKPOINT_FILES",
    "COPY_PREFIX",
    "KIND_NAMES",
    "LINK_ALIASES",
    "LINK_NAMES",
    "MIN_PREFIX",
    "MUST_AGREE",
    "NFS_ENV",
    "RUNS_ROOT_ENV",
    "RUN_DIRS",
    "SCRATCH_ENV",
    "SHARDS_ROOT_ENV",
    "SIDECAR_DIR",
    "STAGE_ROOT_ENV",
    "CacheEntry",
    "CopyOptions",
    "Finding",
    "Holder",
    "PathLike",
    "PushReport",
    "RemoteEntry",
    "Root",
    "Roots",
    "Run",
    "StageReport",
    "TransferReport",
    "Unpublished",
    "check_not_in_use",
    "check_reference",
    "compare_caches",
    "compute_stats",
    "copy_cache",
    "create_run",
    "dataset_target",
    "doctor",
    "doctor_environment",
    "find_cache",
    "find_stats",
    "folder_nbytes",
    "is_live",
    "list_caches",
    "list_remote",
    "list_unpublished",
    "local_roots",
    "locate",
    "nested_roots",
    "open_cache",
    "open_quietly",
    "open_run",
    "pull",
    "push",
    "remote_objects",
    "remote_roots",
    "remove",
    "remove_remote",
    "remove_unpublished",
    "resolve",
    "resolve_remote",
    "runs_linking",
    "runs_root",
    "shards_root",
    "shards_roots",
    "sidecar_path",
    "stage",
    "stage_root",
    "summary",
    "unpublished",
    "users",
    "write_sidecar",
]
