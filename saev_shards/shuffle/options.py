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
from typing import Any, TypeVar

from ..errors import ShuffleError
from ..protocol.common import DTYPES
from ..protocol.jsonfile import is_int
from ..selection import SelectionSpec

#: Default memory budget of all processes together: the loaders' default shuffle window is 1 GiB, held twice.
DEFAULT_MEMORY = 2 << 30


@dataclasses.dataclass(frozen=True)
class ShuffleOptions:
    """How a shuffle makes its output and cuts its work (checked when made: `ShuffleError`).

    ``seed`` decides the order (with the source and the selection, nothing else); ``dtype``:
    the output's stored dtype (None: the source's); ``patches_per_shard``: the output's shard
    budget (None: the source's); ``memory_bytes``: what all processes together may hold (the
    number of buckets follows); ``workers``: processes sharing both passes; ``work_dir``: where
    the scratch runs go (None: the output's root); ``allow_nonfinite``: store inf/NaN (after
    the cast) instead of raising `NonFiniteError`. ``n_buckets`` and ``examples_per_chunk``
    override the sizing drawn from ``memory_bytes`` (tests force many buckets on small
    caches with them). The output depends on neither ``workers``, ``work_dir``,
    ``memory_bytes``, ``n_buckets`` nor ``examples_per_chunk``.
    """

    seed: int = 0
    dtype: str | None = None
    patches_per_shard: int | None = None
    memory_bytes: int = DEFAULT_MEMORY
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
        if not is_int(memory, numpy_ok=True) or memory < 1:
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
