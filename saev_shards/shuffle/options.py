"""A shuffle's options, given once: `ShuffleOptions` (how the output is made and the work is cut)
beside the token selection (`saev_shards.selection.SelectionSpec`).

`plan_shuffle` and `shuffle_cache` take both as keyword arguments (``layers=11, seed=0,
memory_bytes=...``), which `split_keywords` sorts into the two; the plan (`make_plan`)
takes them as they are.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ShuffleError
from ..protocol.common import DTYPES
from ..protocol.jsonfile import is_int
from ..selection import SelectionSpec

#: Default memory budget of all processes together: the loaders' default shuffle window is 1 GiB,
#: held twice; half the memory limit of this process's cgroup where that is lower (`default_memory`).
DEFAULT_MEMORY = 2 << 30
#: Where the kernel says which cgroups this process is in, and where their hierarchies are mounted.
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")


def default_memory(proc_cgroup: Path = PROC_CGROUP, proc_mountinfo: Path = PROC_MOUNTINFO) -> int:
    """The budget a shuffle takes when given none: `DEFAULT_MEMORY`, or half of `cgroup_memory_limit`
    where that is lower (a container, a batch job, a benchmark's limit: the page cache and the
    interpreter need the other half; a budget of the whole limit gets the process killed)."""
    limit = cgroup_memory_limit(proc_cgroup, proc_mountinfo)
    return DEFAULT_MEMORY if limit is None else max(1, min(DEFAULT_MEMORY, limit // 2))


def cgroup_memory_limit(proc_cgroup: Path = PROC_CGROUP, proc_mountinfo: Path = PROC_MOUNTINFO) -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (cgroup v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), in bytes; None where none is set or none
    can be read (no cgroup filesystem, another system)."""
    try:
        groups = proc_cgroup.read_text()
        mounts = proc_mountinfo.read_text()
    except OSError:
        return None
    where: dict[str, str] = {}  # "v2" or "v1" -> the cgroup's path in that hierarchy
    for line in groups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            where["v2"] = parts[2]
        elif "memory" in parts[1].split(","):
            where["v1"] = parts[2]
    limits: list[int] = []
    for line in mounts.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2" and "v2" in where:
            kind, name = "v2", "memory.max"
        elif tail[0] == "cgroup" and "memory" in tail[2].split(",") and "v1" in where:
            kind, name = "v1", "memory.limit_in_bytes"
        else:
            continue
        root, point = fields[3].rstrip("/"), Path(fields[4].replace("\\040", " "))
        path = where[kind]
        if root and (path == root or path.startswith(root + "/")):
            path = path[len(root) :]
        folder = point / path.lstrip("/")
        while True:  # the cgroup, then each ancestor up to the hierarchy's root
            try:
                value = (folder / name).read_text().strip()
            except OSError:
                value = ""
            if value.isdigit() and int(value) < 1 << 60:  # v1 writes "no limit" as a huge number
                limits.append(int(value))
            if folder == point or point not in folder.parents:
                break
            folder = folder.parent
    return min(limits) if limits else None


@dataclasses.dataclass(frozen=True)
class ShuffleOptions:
    """How a shuffle makes its output and cuts its work (checked when made: `ShuffleError`).

    ``seed`` decides the order (with the source and the selection, nothing else); ``dtype``:
    the output's stored dtype (None: the source's); ``patches_per_shard``: the output's shard
    budget (None: the source's); ``memory_bytes``: what all processes together may hold (the
    number of buckets follows; None: `default_memory`); ``workers``: processes sharing both passes; ``work_dir``: where
    the scratch runs go (None: the output's root); ``allow_nonfinite``: store inf/NaN (after
    the cast) instead of raising `NonFiniteError`. ``n_buckets`` and ``examples_per_chunk``
    override the sizing drawn from ``memory_bytes`` (tests force many buckets on small
    caches with them). The output depends on neither ``workers``, ``work_dir``,
    ``memory_bytes``, ``n_buckets`` nor ``examples_per_chunk``.
    """

    seed: int = 0
    dtype: str | None = None
    patches_per_shard: int | None = None
    memory_bytes: int | None = None
    workers: int = 1
    work_dir: str | os.PathLike[str] | None = None
    allow_nonfinite: bool = False
    n_buckets: int | None = None
    examples_per_chunk: int | None = None

    def __post_init__(self) -> None:
        seed, workers, memory = self.seed, self.workers, self.memory_bytes
        if not is_int(seed, numpy_ok=True) or not 0 <= int(seed) < 2**63:
            raise ShuffleError(f"seed: expected an integer in [0, 2**63), found {seed!r}")
        if not is_int(workers, numpy_ok=True) or workers < 1:
            raise ShuffleError(f"workers: expected an integer >= 1, found {workers!r}")
        if memory is not None and (not is_int(memory, numpy_ok=True) or memory < 1):
            raise ShuffleError(f"memory: expected a number of bytes >= 1, found {memory!r}")
        if self.dtype is not None and str(self.dtype) not in DTYPES:
            raise ShuffleError(f"dtype: expected one of {list(DTYPES)}, found {self.dtype!r}")
        if self.patches_per_shard is not None and not is_int(self.patches_per_shard, numpy_ok=True):
            raise ShuffleError(f"patches_per_shard: expected an integer, found {self.patches_per_shard!r}")
        for name in ("n_buckets", "examples_per_chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ShuffleError(f"{name}: expected an integer >= 1, found {value!r}")


#: The keyword arguments `plan_shuffle` and `shuffle_cache` sort into a spec and options.
KEYWORDS = (SelectionSpec, ShuffleOptions)


def split_keywords(caller: str, keywords: Mapping[str, Any]) -> tuple[SelectionSpec, ShuffleOptions]:
    """``keywords`` as the selection and the options; `TypeError` for a name neither has, as
    Python's own for an unexpected keyword argument of ``caller``."""
    fields = {cls: {f.name for f in dataclasses.fields(cls)} for cls in KEYWORDS}
    for name in keywords:
        if not any(name in names for names in fields.values()):
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    spec = SelectionSpec(**{k: v for k, v in keywords.items() if k in fields[SelectionSpec]})
    options = ShuffleOptions(**{k: v for k, v in keywords.items() if k in fields[ShuffleOptions]})
    return spec, options


F = TypeVar("F", bound=Callable[..., Any])


def takes_keywords(fn: F) -> F:
    """Give ``fn`` (whose ``**keywords`` go to `split_keywords`) the signature it accepts: its own
    parameters, with the selection's and the options' fields as keyword-only ones in their place
    (what `help` and `inspect.signature` show)."""
    own = inspect.signature(fn)
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(params))
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for cls in KEYWORDS
        for f in dataclasses.fields(cls)
    ]
    fn.__dict__["__signature__"] = own.replace(parameters=[*params[:at], *fields, *params[at:]])
    return fn
