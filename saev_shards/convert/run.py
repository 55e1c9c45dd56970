"""The conversion itself, the same for every source kind and target.

SourcePlan the source (`base.SourcePlan`), derive the cache's `Metadata` from the plan and the target,
then stream the source's chunks into a `ShardWriter` that publishes atomically. The
writer's bytes depend only on the data, never on how it was chunked, and the plan only on
the source, so a run killed at any point resumes (``resume=True``) after the last sealed
shard and publishes exactly the bytes an uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..codecs import dtypes
from ..errors import ConvertError, ConvertOptionError, NonFiniteError, ShardsError, SourceNotFoundError
from ..fileio import check_free_space
from ..progress import Progress
from ..protocol.common import FLOAT8, PROTOCOL, V3_PROTOCOLS
from ..protocol.metadata import Metadata
from ..store import check_reference, resolve, shards_root
from ..writer import ShardWriter, space_needed
from . import cache
from .base import CONVERT_VERSION, Options, Report, Source, SourcePlan
from .registry import SourceKind, Target, detect, source_kind, target

#: The protocol's default shard budget in token vectors (protocol.md section 3).
DEFAULT_PATCHES_PER_SHARD = 2_400_000


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A planned conversion: the source, its kind, the target and the cache's metadata."""

    kind: SourceKind
    source: Source
    target: Target
    metadata: Metadata
    root: Path

    @property
    def plan(self) -> SourcePlan:
        return self.source.plan

    @property
    def path(self) -> Path:
        """Where the cache is (or will be) published."""
        return self.root / self.metadata.hash


@dataclasses.dataclass(frozen=True)
class Result:
    """What `convert` did: the published cache, where it resumed, and what was not carried over."""

    path: Path
    metadata: Metadata
    plan: SourcePlan
    report: Report
    resumed_at: int
    examples_written: int
    seconds: float
    already_published: bool


def metadata_for(plan: SourcePlan, to: Target, dtype: str | None, patches_per_shard: int | None) -> Metadata:
    """The cache's metadata: the plan's shape and model, the source's description in ``data``
    (a cache source keeps its own fields: `cache.target_metadata`). ``dtype`` None: the
    target's default (a cache's own dtype where the target stores it)."""
    if dtype is not None and dtype not in to.dtypes:
        raise ConvertOptionError(f"--dtype: target {to.name} stores {', '.join(to.dtypes)}; found {dtype!r}")
    if plan.cache is not None:
        if dtype is None and plan.cache.dtype not in to.dtypes:
            dtype = to.default_dtype
        try:
            return cache.target_metadata(plan, plan.cache, to.protocol, dtype, patches_per_shard)
        except ConvertOptionError:
            raise
        except ShardsError as err:
            raise ConvertError(f"{plan.path}: cannot be written as {to.name}: {err}") from None
    dtype = dtype or to.default_dtype
    if dtype not in to.dtypes:
        raise ConvertOptionError(f"--dtype: target {to.name} stores {', '.join(to.dtypes)}; found {dtype!r}")
    tokens = plan.tokens
    if plan.cls_token and tokens < 1:
        raise ConvertOptionError("--cls-token: the examples have no token to be the [CLS] token")
    budget = patches_per_shard if patches_per_shard is not None else DEFAULT_PATCHES_PER_SHARD
    one_example = tokens * len(plan.layers)
    if patches_per_shard is None:
        budget = max(budget, one_example)  # very long examples: one per shard
    elif budget < one_example:
        raise ConvertOptionError(
            f"--patches-per-shard: one example holds {one_example:,} token vectors ({len(plan.layers)} layers x "
            f"{tokens} tokens), more than the budget {budget:,}"
        )
    data = {"converted_from": {"kind": plan.kind, "version": CONVERT_VERSION}, "source": dict(plan.source)}
    if to.protocol not in V3_PROTOCOLS:
        cache.check_saev_family(plan.family, plan.cls_token)
    try:
        return Metadata(
            family=plan.family,
            ckpt=plan.ckpt,
            layers=plan.layers,
            patches_per_ex=tokens - int(plan.cls_token),
            cls_token=plan.cls_token,
            d_model=plan.d_model,
            n_examples=plan.n_examples,
            patches_per_shard=budget,
            data=data if to.protocol in V3_PROTOCOLS else cache.saev_data(data),
            dataset=plan.dataset,
            dtype=dtype,
            protocol=to.protocol,
        )
    except ShardsError as err:
        raise ConvertError(f"{plan.path}: the source does not make a valid cache: {err}") from None


def prepare(
    src: str | os.PathLike[str],
    *,
    kind: str | None = None,
    to: str = PROTOCOL,
    root: str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    patches_per_shard: int | None = None,
    options: Options | None = None,
    scan: Callable[[int, int], None] | None = None,
) -> Prepared:
    """Detect the source's kind (or take ``kind``), plan it and derive the cache's metadata.

    Every problem with the source is a `ConvertError` (or another `ShardsError`) naming the
    file; one that needs more memory than ``options.memory_bytes`` allows says so."""
    text = os.fspath(src)
    check_reference(text, "source")
    path = Path(text).expanduser().absolute()
    if not path.exists() and kind in (None, cache.KIND) and re.fullmatch(r"[0-9a-f]{4,64}", text):
        path = resolve(text)  # a cache's hash prefix, in the shards roots (CacheNotFoundError names them)
    if not path.exists():
        if os.path.lexists(path):
            raise ConvertError(f"{path}: a symbolic link that leads nowhere (to nothing, or in a loop)")
        raise SourceNotFoundError(f"{path}: no such file or directory")
    the_target = target(to)
    the_kind = source_kind(kind) if kind is not None else detect(path)
    module = the_kind.load()
    out_root = shards_root(root).path
    options = options or Options()
    try:
        try:
            opened: Source = module.open_source(path, options, scan=scan)
        except ShardsError as err:
            if kind is not None and not module.detect(path):  # say both: the kind named, and why not
                raise ConvertOptionError(
                    f"{path}: does not look like a {the_kind.name} source ({the_kind.summary}): {err}"
                ) from None
            raise
    except MemoryError:
        raise ConvertError(
            f"{path}: ran out of memory while reading the source (--max-memory {options.memory:,} bytes: "
            "lower it to refuse large pieces up front, or free memory)"
        ) from None
    md = metadata_for(opened.plan, the_target, dtype, patches_per_shard)
    return Prepared(the_kind, opened, the_target, md, out_root)


def _nonfinite_message(err: NonFiniteError, dtype: str) -> str:
    # A wider dtype holds what overflowed float16 (or bfloat16); float8_e4m3 scales every vector,
    # so only inf or NaN in the source itself is refused there.
    wider = "float32" if dtype in ("float16", "bfloat16") else None
    hint = f"re-run with --dtype {wider} (or bfloat16), or " if wider else "re-run with "
    return f"{err}; {hint}--allow-nonfinite to store them as they are (nothing was published)"


def run(
    prepared: Prepared,
    *,
    allow_nonfinite: bool = False,
    stats: bool = True,
    restart: bool = False,
    progress: bool | None = None,
    durable: bool = True,
    log: Callable[[str], None] | None = None,
    check_space: bool = True,
) -> Result:
    """Stream the prepared source into its cache and publish it; resumes unless ``restart``.

    Before anything is written, ``check_space`` refuses with `DiskFullError` when what is
    still to write (`space_needed`: from the plan, which each source kind makes from what
    the source holds, not only from what it declares) exceeds the free space under the
    root (``check_space=False``, ``--no-space-check`` or ``SAEV_SHARDS_NO_SPACE_CHECK=1``
    to skip it); a disk that fills up anyway raises `DiskFullError` naming the file, and
    the same call after freeing space resumes."""
    plan, md, to = prepared.plan, prepared.metadata, prepared.target
    report = _notes(prepared)
    t0 = time.perf_counter()
    if prepared.path.exists():
        return Result(prepared.path, md, plan, report, md.n_examples, 0, 0.0, True)
    columns = dict(plan.columns) if to.extras else {}
    text = plan.text if to.extras else ()
    if not to.extras and (plan.columns or plan.text):
        dropped = [*(f"column {c}" for c in plan.columns), *(f"text {t}" for t in plan.text)]
        report.note(f"{', '.join(dropped)} not carried over (protocol {to.protocol} holds activations only)")
    if check_space:
        needed = space_needed(
            md, prepared.root, columns=columns, text=lambda a, b: [2 * (b - a)] * len(text), restart=restart
        )
        check_free_space(prepared.root, needed, f"converting {plan.path}", "pass --no-space-check (check_space=False)")
    writer = ShardWriter(
        prepared.root,
        md,
        resume=not restart,
        allow_nonfinite=allow_nonfinite,
        stats=stats and to.extras,
        labels=plan.labels,
        columns={name: (dt, tail) for name, (dt, tail) in columns.items()},
        text=text,
        durable=durable,
    )
    start = writer.next_example
    if start > 0:
        (log or (lambda _msg: None))(f"resuming at example {start:,} ({start:,} of {md.n_examples:,} already sealed)")
    try:
        written = _write(prepared, writer, report, progress, columns, text)
        path = writer.close()
    except NonFiniteError as err:
        writer.abort()
        raise ConvertError(_nonfinite_message(err, md.dtype)) from None
    except MemoryError:
        writer.abort()
        raise ConvertError(
            f"{plan.path}: ran out of memory while converting (lower --max-memory, or free memory)"
        ) from None
    except BaseException:
        writer.abort()
        raise
    assert path is not None  # a single writer publishes on close
    return Result(path, md, plan, report, start, written, time.perf_counter() - t0, False)


def _notes(prepared: Prepared) -> Report:
    """A new report holding what the plan (and a cache source's target) says up front."""
    report = Report()
    for note in prepared.plan.notes:
        report.note(note)
    if isinstance(prepared.source, cache.CacheSource):
        has_stats = prepared.source.shards.manifest.stats is not None
        for note in cache.target_notes(prepared.source.shards.metadata, prepared.metadata, has_stats):
            report.note(note)
    return report


def _write(
    prepared: Prepared,
    writer: ShardWriter,
    report: Report,
    progress: bool | None,
    columns: dict[str, Any],
    text: tuple[str, ...],
) -> int:
    """Stream the source's chunks from ``writer.next_example`` into ``writer`` (``columns`` and
    ``text``: what the target keeps of them); the examples written."""
    plan, md = prepared.plan, prepared.metadata
    start = writer.next_example
    written = 0
    with Progress(
        (md.n_examples - start) * md.example_nbytes, f"convert {plan.kind}", unit="B", enabled=progress
    ) as bar:
        for chunk in prepared.source.chunks(start, report):
            n = chunk.acts.shape[0]
            if n == 0:
                continue
            cols: dict[str, Any] = {k: v for k, v in chunk.columns.items() if k in columns}
            if "lengths" in columns and "lengths" not in cols:
                raise ConvertError(f"{plan.path}: internal: a chunk came without its lengths")
            acts, scales = chunk.acts, chunk.scales
            if scales is not None and md.dtype != FLOAT8:  # a float8_e4m3 source into another dtype
                acts, scales = dtypes.convert(acts, FLOAT8, "float32", scales), None
            writer.write(
                acts,
                labels=chunk.labels if plan.labels else None,
                columns=cols or None,
                text={k: v for k, v in chunk.text.items() if k in text} or None,
                scales=scales,
            )
            written += n
            bar.update(n * md.example_nbytes, extra=f"{start + written:,}/{md.n_examples:,} examples")
    return written


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """Everything `convert` takes besides the source: what is written where (`prepare`'s
    keywords) and how (`run`'s). `convert`'s keyword arguments are these fields.

    ``kind``: the source kind (None: detected); ``to``: the target (a protocol version, or
    ``"saev"``); ``root``: the shards root to publish in (None: the default root); ``dtype``:
    the stored dtype (None: the target's default, a cache's own where the target stores it);
    ``patches_per_shard``: the shard budget (None: the protocol's default, at least one
    example); ``options``: how the source's examples become the cache's (`Options`);
    ``allow_nonfinite``: store inf/NaN after the cast instead of failing; ``stats``:
    write stats.json; ``restart``: discard the sealed shards of an interrupted run;
    ``progress``: a progress bar (None: when stderr is a terminal); ``durable``: fsync;
    ``check_space``: refuse up front when the free space is too small (`run`).
    """

    kind: str | None = None
    to: str = PROTOCOL
    root: str | os.PathLike[str] | None = None
    dtype: str | None = None
    patches_per_shard: int | None = None
    options: Options | None = None
    allow_nonfinite: bool = False
    stats: bool = True
    restart: bool = False
    progress: bool | None = False
    durable: bool = True
    check_space: bool = True

    def keywords_of(self, step: Callable[..., Any]) -> dict[str, Any]:
        """The fields that are keyword arguments of ``step`` (`prepare` or `run`)."""
        names = inspect.signature(step).parameters
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}


def convert(src: str | os.PathLike[str], **keywords: Any) -> Result:
    """Convert ``src`` into a cache under ``root`` (default: the shards root); returns the `Result`.

    The keywords are `ConvertOptions`' fields (``kind``, ``to``, ``root``, ``dtype``,
    ``patches_per_shard``, ``options``, ``allow_nonfinite``, ``stats``, ``restart``,
    ``progress``, ``durable``, ``check_space``): `prepare` and `run` in one call.

    >>> result = convert("activations/", root="shards")       # doctest: +SKIP
    >>> ss.open(result.path)                                     # doctest: +SKIP
    """
    try:
        settings = ConvertOptions(**keywords)
    except TypeError as err:  # an unknown keyword: said as Python says it of a function
        raise TypeError(str(err).replace("ConvertOptions.__init__()", "convert()")) from None
    return run(prepare(src, **settings.keywords_of(prepare)), **settings.keywords_of(run))


convert.__dict__["__signature__"] = inspect.Signature(
    [
        inspect.Parameter("src", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str | os.PathLike[str]"),
        *(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in dataclasses.fields(ConvertOptions)
        ),
    ],
    return_annotation="Result",
)
