"""The files a cache's manifest lists, checked before `open` returns a `Shards`: every shard's
name and size, the scale files of a float8_e4m3 cache, labels, columns, text, blocks.json and
stats.json against the shapes the metadata gives them, each file on disk a regular file of
its size, and no data file in the folder that the manifest does not list (protocol.md 7).

``on_disk=False`` checks the listing alone (a remote cache, whose files are not in a folder).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import (
    CacheNotFoundError,
    FileSizeError,
    ManifestError,
    Problem,
    UnexpectedFileError,
)
from ..fileio import file_kind
from ..protocol.common import (
    BLOCKS_FILE,
    LABELS_FILE,
    MANIFEST_FILE,
    SCALES_NAME_RE,
    SHARD_NAME_RE,
    STATS_FILE,
    blocks_max_bytes,
    scales_name,
    stats_max_bytes,
)
from ..protocol.jsonfile import short_repr
from ..protocol.manifest import Manifest
from ..protocol.metadata import Metadata


def check_shards(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool = True) -> list[Problem]:
    """The shards' names, example counts and sizes against the metadata's; with ``on_disk``,
    each shard file itself (`check_files`)."""
    problems: list[Problem] = []
    where = root / MANIFEST_FILE
    expected = md.n_shards
    if len(manifest.shards) != expected:
        problems.append(
            Problem(
                ManifestError,
                f"{where}: expected {expected} shards for n_examples={md.n_examples} and "
                f"examples_per_shard={md.examples_per_shard}, found {len(manifest.shards)}",
            )
        )
    eps = md.examples_per_shard
    example_nbytes = md.example_nbytes
    # One pass of list comparisons for the common, valid manifest (10^4 shards in a few ms);
    # entry-by-entry messages only for entries that differ.
    count = len(manifest.shards)
    want_names = _shard_names(min(count, 1_000_000))
    last = md.n_examples - (expected - 1) * eps
    extra = [0] * max(0, count - expected)
    want_counts = (([eps] * (expected - 1) + [last] if expected else []) + extra)[:count]
    names, counts, sizes = manifest.shards.names, manifest.shards.counts, manifest.shards.sizes
    # list arithmetic, not a loop: 10^4 shards
    full = eps * example_nbytes
    want_sizes = (([full] * (expected - 1) + [last * example_nbytes] if expected else []) + extra)[:count]
    if md.rules.padded_last and count == expected and expected and sizes[-1] == full:
        want_sizes[-1] = full  # 2.1: the last shard's file padded to a full shard
    if names == want_names and counts == want_counts and sizes == want_sizes:
        if on_disk:
            problems.extend(check_files(root, names, sizes))
        return problems
    ok_names: list[str] = []
    ok_sizes: list[int] = []
    for i, s in enumerate(manifest.shards):
        if i >= len(want_names) or s.name != want_names[i]:
            want = want_names[i] if i < len(want_names) else "(none: too many shards)"
            hint = "" if SHARD_NAME_RE.fullmatch(s.name) else " (shard names are plain acts<06d>.bin, no paths)"
            problems.append(
                Problem(ManifestError, f"{where}: shard {i}: expected name {want!r}, found {short_repr(s.name)}{hint}")
            )
        elif s.n_examples != want_counts[i]:
            problems.append(
                Problem(ManifestError, f"{where}: {s.name}: expected n_examples={want_counts[i]}, found {s.n_examples}")
            )
        elif s.nbytes != want_sizes[i]:
            problems.append(
                Problem(ManifestError, f"{where}: {s.name}: expected nbytes={want_sizes[i]}, found {s.nbytes}")
            )
        else:
            ok_names.append(s.name)
            ok_sizes.append(s.nbytes)
    if on_disk:
        problems.extend(check_files(root, ok_names, ok_sizes))
    return problems


def check_scales(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool = True) -> list[Problem]:
    """A float8_e4m3 cache's scale files (protocol 3.1): one per shard, named for it, a float32
    per vector of its examples, each a regular file of that size."""
    where = root / MANIFEST_FILE
    scales = manifest.scales
    assert scales is not None
    if len(scales) != md.n_shards:
        return [
            Problem(
                ManifestError, f"{where}: scales: expected {md.n_shards} entries (one per shard), found {len(scales)}"
            )
        ]
    problems: list[Problem] = []
    ok_names: list[str] = []
    ok_sizes: list[int] = []
    for k, (name, nbytes) in enumerate(zip(scales.names, scales.sizes, strict=True)):
        want = md.shard_scales_nbytes(k)
        if name != scales_name(k):
            problems.append(
                Problem(
                    ManifestError, f"{where}: scales[{k}]: expected name {scales_name(k)!r}, found {short_repr(name)}"
                )
            )
        elif nbytes != want:
            problems.append(Problem(ManifestError, f"{where}: {name}: expected nbytes={want}, found {nbytes}"))
        else:
            ok_names.append(name)
            ok_sizes.append(nbytes)
    if on_disk:
        problems.extend(check_files(root, ok_names, ok_sizes))
    return problems


_SHARD_NAMES: list[str] = []


def _shard_names(count: int) -> list[str]:
    """``[acts000000.bin, ...]`` of length ``count``, built once per process and extended as needed."""
    if len(_SHARD_NAMES) < count:
        _SHARD_NAMES.extend(f"acts{i:06d}.bin" for i in range(len(_SHARD_NAMES), count))
    return _SHARD_NAMES[:count]


def check_files(root: Path, names: Sequence[str], sizes: Sequence[int]) -> list[Problem]:
    """``lstat`` each file ``names[i]`` in ``root`` (relative to a directory fd: no path parsing)
    and check it is a regular file (a symbolic link is not) of ``sizes[i]`` bytes; one pass,
    problems worded only on failure. ``names`` are validated names: plain ``acts<06d>.bin``."""
    if not names:
        return []
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        regular = stat.S_ISREG
        bad = [
            i
            for i, (name, nbytes) in enumerate(zip(names, sizes, strict=True))
            if (st := os.stat(name, dir_fd=dir_fd, follow_symlinks=False)).st_size != nbytes or not regular(st.st_mode)
        ]
    except OSError:
        bad = list(range(len(names)))  # something is missing: the slow path words each problem
    finally:
        os.close(dir_fd)
    problems: list[Problem] = []
    for i in bad:
        problems.extend(_check_one_file(root / names[i], sizes[i]))
    return problems


def _check_one_file(path: Path, nbytes: int) -> list[Problem]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return [Problem(CacheNotFoundError, f"{path}: missing")]
    except OSError as err:
        return [Problem(CacheNotFoundError, f"{path}: cannot stat ({err.strerror})")]
    if not stat.S_ISREG(st.st_mode):
        return [Problem(ManifestError, f"{path}: expected a regular file, found {file_kind(st.st_mode)}")]
    if st.st_size != nbytes:
        hint = " (file seems not fully written?)" if st.st_size < nbytes else ""
        return [Problem(FileSizeError, f"{path}: expected {nbytes} bytes, found {st.st_size}{hint}")]
    return []


def check_other_files(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool = True) -> list[Problem]:
    """The shapes and sizes the manifest gives the files beside the shards; with ``on_disk``,
    also each file itself, and no unlisted data file in ``root``."""
    problems = _listed_file_problems(root, md, manifest, on_disk=on_disk)
    if on_disk:
        problems += _unlisted_file_problems(root, md, manifest)
    return problems


def _listed_file_problems(root: Path, md: Metadata, manifest: Manifest, *, on_disk: bool) -> list[Problem]:
    """The shapes and sizes the manifest gives labels, columns, text, blocks.json and
    stats.json; with ``on_disk``, also each file itself (`_check_one_file`)."""
    problems: list[Problem] = []
    where = root / MANIFEST_FILE

    def _check_file(path: Path, nbytes: int) -> list[Problem]:
        return _check_one_file(path, nbytes) if on_disk else []

    if manifest.labels is not None:
        want = (md.n_examples, md.patches_per_ex)
        lab = manifest.labels
        if lab.shape != want or lab.nbytes != md.n_examples * md.patches_per_ex:
            problems.append(
                Problem(ManifestError, f"{where}: labels: expected shape {list(want)} uint8, found {list(lab.shape)}")
            )
        else:
            problems.extend(_check_file(root / lab.name, lab.nbytes))
    for name, col in manifest.columns.items():
        itemsize = np.dtype(col.dtype).itemsize
        want_nbytes = int(np.prod(col.shape, dtype=object)) * itemsize
        if col.shape[0] != md.n_examples or col.nbytes != want_nbytes:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: columns.{name}: expected shape ({md.n_examples}, ...) and nbytes = "
                    f"prod(shape) * {itemsize}, found shape {list(col.shape)} nbytes {col.nbytes}",
                )
            )
        else:
            problems.extend(_check_file(root / col.name, col.nbytes))
    for name, txt in manifest.text.items():
        if txt.n_lines != md.n_examples:
            problems.append(
                Problem(ManifestError, f"{where}: text.{name}: expected n_lines={md.n_examples}, found {txt.n_lines}")
            )
        else:
            problems.extend(_check_file(root / txt.name, txt.nbytes))
    if manifest.blocks is not None:
        cap = blocks_max_bytes([n for _, n, _ in manifest.blocked_files()])
        if manifest.blocks.nbytes > cap:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: blocks.nbytes: expected at most {cap:,} bytes for the files listed, "
                    f"found {manifest.blocks.nbytes:,}",
                )
            )
        else:
            problems.extend(_check_file(root / manifest.blocks.name, manifest.blocks.nbytes))
    if manifest.stats is not None:
        cap = stats_max_bytes(md.n_layers, md.d_model)
        if manifest.stats.nbytes > cap:
            problems.append(
                Problem(
                    ManifestError,
                    f"{where}: stats.nbytes: expected at most {cap:,} bytes for {md.n_layers} layers of "
                    f"{md.d_model} dimensions, found {manifest.stats.nbytes:,}",
                )
            )
        else:
            problems.extend(_check_file(root / manifest.stats.name, manifest.stats.nbytes))
    return problems


def _unlisted_file_problems(root: Path, md: Metadata, manifest: Manifest) -> list[Problem]:
    """A data file in ``root`` (a shard's name, labels, stats, a column, text; blocks.json and
    scale files from protocol 3.1 on) that the manifest does not list."""
    present = set(os.listdir(root))
    unlisted = present.difference(manifest.shards.names)  # set operations in C: 10^4 names
    unlisted.difference_update(manifest.empty_shards.names)
    unlisted.difference_update(manifest.scales.names if manifest.scales is not None else ())
    unlisted.difference_update(name for name, _, _ in manifest.other_files())
    if manifest.blocks is not None:
        unlisted.discard(manifest.blocks.name)
    v31 = md.rules.block_size is not None  # the names protocol 3.1 gave a meaning
    listing = md.rules.manifest_file
    unlisted_why = (
        f"not listed in {listing}"
        if listing is not None
        else f"beyond the shards of n_examples={md.n_examples} ({md.rules.summary} has no {MANIFEST_FILE})"
    )
    return [
        Problem(UnexpectedFileError, f"{root / name}: data file {unlisted_why}")
        for name in sorted(unlisted)
        if SHARD_NAME_RE.fullmatch(name)
        or name in (LABELS_FILE, STATS_FILE)
        or (name.startswith(("column.", "text.")) and name.endswith((".bin", ".jsonl")))
        or (v31 and (name == BLOCKS_FILE or SCALES_NAME_RE.fullmatch(name) is not None))
    ]
