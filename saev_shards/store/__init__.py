"""The shard store: where caches and runs live, how a hash names a cache, local copies, runs.

* `roots`: the shards, runs and stage roots, and `resolve` (a path, a full hash or a
  unique prefix -> one cache); `open_cache` (`saev_shards.open`) resolves, then opens;
* `caches`: what a root holds: `list_caches`, `unpublished` (staging and copying folders
  with size, age and whether their writer is alive), `remove`, `remove_unpublished`, `summary`;
* `sidecar`: statistics computed for an existing cache, kept in ``<root>/.stats/`` and
  found by `Shards.stats` (`compute_stats`, `write_sidecar`, `find_stats`);
* `staging`: `stage` / `copy_cache`, a verified, atomic, resumable local copy;
* `remote`: shards roots in object stores: `push`, `list_remote`, `resolve_remote`,
  `locate` (a URL, a local reference, or a hash found in a remote root), `remove_remote`,
  `nested_roots` (roots below a bucket's top); `staging.pull` copies a remote cache to
  local disk like `stage`;
* `runs`: run folders (`create_run`, `open_run`, `Run`);
* `doctor`: what is wrong with a run (`doctor`) or with the configured roots
  (`doctor_environment`).

>>> path = resolve("3f2a")              # doctest: +SKIP  (a unique prefix, like git)
>>> shards = stage("3f2a")              # doctest: +SKIP  (verified local copy, opened)
>>> run = create_run("3f2a", "9c1d", run_id="sae-16k")   # doctest: +SKIP
>>> run.train_shards, run.sae_checkpoint                 # doctest: +SKIP
"""

from __future__ import annotations

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
    summary,
    unpublished,
)
from .doctor import Finding, doctor, doctor_environment
from .inuse import Holder, users
from .remote import (
    PushReport,
    RemoteEntry,
    list_remote,
    locate,
    nested_roots,
    push,
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
from .runs import (
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
from .staging import StageReport, copy_cache, pull, stage

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
    "Finding",
    "Holder",
    "PathLike",
    "PushReport",
    "RemoteEntry",
    "Root",
    "Roots",
    "Run",
    "StageReport",
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
