"""Checks that explain what is wrong: a run folder (`doctor`), and the configured roots (`doctor_environment`)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from .. import reader
from ..errors import (
    RootNotSetError,
    ShardsError,
)
from .caches import list_unpublished, open_quietly
from .roots import PathLike, Root, Roots, _scan, runs_root, shards_roots, stage_root
from .run_folders import CHECKPOINT_FILES, LINK_NAMES, Run, compare_caches, dataset_target, open_run


def _one_line(err: Exception, cache: Path) -> str:
    """An error listing several problems, on one line (a report has one line per finding),
    with the files of ``cache`` named relative to it (the line already shows where it is)."""
    text = str(err).replace(f"{cache}/", "").replace(f"{cache}: ", "")
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


@dataclasses.dataclass(frozen=True)
class Finding:
    """One line of a `doctor` report: ``level`` is "ok", "note", "warning" or "error"."""

    level: str
    subject: str
    message: str


def doctor(
    run: PathLike | Run,
    *,
    verify: bool = False,
    require_checkpoint: bool = False,
    progress: bool | None = False,
    runs_root: PathLike | None = None,
) -> list[Finding]:
    """Check a run folder: its links (missing, dangling, not symlinks, caches that do not
    open or, with ``verify``, fail their checksums), its checkpoint and inference folders
    and files, and that the train and val caches are compatible. Errors make the run
    unusable; a dataset link is never required (training reads only the shards), and a
    cache whose dataset is a name rather than a path has none (`dataset_target`).
    """
    r = run if isinstance(run, Run) else open_run(run, runs_root)
    findings: list[Finding] = []

    def add(level: str, subject: str, message: str) -> None:
        findings.append(Finding(level, subject, message))

    opened: dict[str, reader.Shards] = {}
    if not r.links_dir.is_dir():
        add("error", "links/", "missing; expected a folder of symlinks " + ", ".join(LINK_NAMES))
    else:
        for name in LINK_NAMES:
            cache = _check_link(r, name, opened, add, verify, progress)
            if cache is not None:
                opened[name] = cache
        checked = {r.link(name).name for name in LINK_NAMES}
        for e in sorted(_scan(r.links_dir), key=lambda e: e.name):
            p = Path(e.path)
            if e.name in checked:
                continue
            if p.is_symlink() and not p.exists():
                add("error", f"links/{e.name}", f"dangling: points to {os.readlink(p)}, which does not exist")
    if not r.inference_root.is_dir():
        add("warning", "inference/", f"missing; saev's own Run refuses a run without it (mkdir {r.inference_root})")
    _check_checkpoint(r, add, require_checkpoint)
    train, val = opened.get("train-shards"), opened.get("val-shards")
    if train is not None and val is not None:
        for problem in compare_caches(train.metadata, val.metadata):
            add("warning", "links/val-shards", problem)
    return findings


#: How `doctor`'s checks report a finding: ``add(level, subject, message)``.
_Add = Callable[[str, str, str], None]


def _check_link(
    r: Run, name: str, opened: dict[str, reader.Shards], add: _Add, verify: bool, progress: bool | None
) -> reader.Shards | None:
    """Check the link ``name`` of the run ``r``; the cache it leads to, opened, if it does."""
    link = r.link(name)
    subject = f"links/{link.name}"
    if not os.path.lexists(link):
        cache_of = opened.get(name.replace("-dataset", "-shards"))
        if name == "train-shards":
            add("error", subject, "missing")
        elif name.endswith("-dataset") and cache_of is not None:
            target, why = dataset_target(cache_of.metadata)
            if target is None:
                add("note", subject, f"not linked: {why} (training needs only the shards)")
            else:
                add("warning", subject, f"missing, though the cache's dataset {target} exists here")
        else:
            add("note", subject, "not linked (optional)")
        return None
    if link.is_symlink() and not link.exists():
        add("error", subject, f"dangling: points to {os.readlink(link)}, which does not exist")
        return None
    shown = f"-> {os.readlink(link)}" if link.is_symlink() else "(a real folder, not a symlink)"
    if not link.is_symlink():
        add("warning", subject, "not a symlink; runs should link to the one shared copy")
    if name.endswith("-dataset"):  # a folder of images, or the one file a text dump read
        if link.is_dir() or link.is_file():
            add("ok", subject, shown)
        else:
            add("error", subject, f"{shown}: not a folder or a regular file")
        return None
    target = link.resolve()
    try:
        cache = open_quietly(target)
    except ShardsError as err:
        add("error", subject, f"{shown}: not a valid cache: {_one_line(err, target)}")
        return None
    verified = ""
    if verify:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                nbytes = cache.verify(progress=progress)
        except ShardsError as err:
            add("error", subject, f"{shown}: verification failed: {_one_line(err, target)}")
            return cache
        verified = f", {nbytes:,} bytes verified"
    md = cache.metadata
    add("ok", subject, f"{shown} ({md.n_examples:,} examples, {md.dtype}, layers {list(md.layers)}{verified})")
    return cache


def _check_checkpoint(r: Run, add: _Add, require_checkpoint: bool) -> None:
    """Check the checkpoint folder of the run ``r`` and the files training writes into it."""
    if not r.checkpoint_dir.is_dir():
        add("error", "checkpoint/", "missing; expected the folder training writes into")
        return
    for fname in CHECKPOINT_FILES:
        p = r.checkpoint_dir / fname
        subject = f"checkpoint/{fname}"
        if not p.exists():
            if p.is_symlink():
                add("error", subject, f"dangling: points to {os.readlink(p)}, which does not exist")
            elif require_checkpoint:
                add("error", subject, "missing")
            else:
                add("note", subject, "not written yet (the run has not been trained)")
        elif not p.is_file():
            add("error", subject, "not a regular file")
        elif p.stat().st_size == 0:
            add("error", subject, "empty file")
        else:
            add("ok", subject, f"{p.stat().st_size:,} bytes")


def doctor_environment(roots: Roots = None, runs_root_arg: PathLike | None = None) -> list[Finding]:
    """Check the configured roots: which are set (and from where), which exist, and the
    unpublished folders each shards root holds."""
    findings: list[Finding] = []

    def check(kind: str, get: Callable[[], list[Root]]) -> None:
        try:
            found = get()
        except RootNotSetError as err:
            findings.append(Finding("error", kind, str(err)))
            return
        for root in found:
            if not root.path.is_dir():
                findings.append(Finding("warning", kind, f"{root} does not exist yet"))
                continue
            findings.append(Finding("ok", kind, str(root)))
            if kind == "shards root":
                findings.extend(
                    Finding("note", kind, f"unpublished (being written, or interrupted): {p}")
                    for p in list_unpublished(root.path)
                )

    check("shards root", lambda: shards_roots(roots))
    check("runs root", lambda: [runs_root(runs_root_arg)])
    check("stage root", lambda: [stage_root(None)])
    return findings
