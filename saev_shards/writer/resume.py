"""Where a writer starts: it locks the staging directory, clears or keeps what earlier
runs left there, and finds the shards they sealed (protocol.md section 6)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import WriterBusyError, WriterError
from ..fileio import BlockHasher, fault_point, hash_file, make_owner_writable, remove_path, take_lock, write_file_atomic
from ..protocol.common import (
    FLOAT8,
    LABELS_FILE,
    METADATA_FILE,
    STATS_FILE,
    column_file,
    scales_name,
    shard_name,
    text_file,
)
from ..protocol.jsonfile import strict_json_loads
from ..protocol.metadata import Metadata
from ..protocol.staging import ACTS, SCALES, part_file, part_record, range_lock, staging_dir
from ..statistics import StatsAccumulator
from .finalize import read_commit, unfinalize
from .staging import take_writer_lock
from .streams import Parts, StreamSpec


def open_staging(
    root: Path, md: Metadata, shards: range, world_size: int, resume: bool, derived: dict[str, str], durable: bool
) -> tuple[int, int | None, bool]:
    """Lock and prepare ``md``'s staging directory for the writer of ``shards``; returns
    ``(lock fd, range lock fd or None, committed)``, where ``committed`` says staging
    already holds this cache finalized (killed before its rename) and ``resume`` keeps it.
    ``derived`` is what `derived_files` says the writer's streams make."""
    staging = staging_dir(root, md)
    single = world_size == 1
    busy = f"{staging} is locked by another writer" + ("" if single else " that is finalizing")
    lock_fd = take_writer_lock(root, md, shared=not single, busy=busy)
    range_lock_fd = None
    committed = False
    try:
        staging.mkdir(exist_ok=True)
        make_owner_writable(staging)  # a killed finalize may have frozen it
        if not single and shards:
            range_lock_fd = take_lock(staging / range_lock(shards))
            if range_lock_fd is None:
                raise WriterBusyError(
                    f"{staging}: shards [{shards.start}, {shards.stop}) are being written by "
                    "another process (this rank started twice?)"
                )
        commit = read_commit(staging, md)
        if commit is not None:
            if resume and commit.derived == derived:
                committed = True  # finalized but not renamed: nothing left to write
            else:
                unfinalize(staging, md)  # back to part records (restart, or other streams)
        if not resume:
            _clear_staging(staging, shards, single)
        expected = md.to_bytes()
        md_path = staging / METADATA_FILE
        if md_path.exists():
            if md_path.read_bytes() != expected:
                raise WriterError(f"{md_path} does not match this writer's metadata; remove {staging}")
        else:
            write_file_atomic(md_path, expected, durable)
        fault_point("writer-ready")
    except BaseException:
        for fd in (range_lock_fd, lock_fd):  # the range lock is only held under the other
            if fd is not None:
                os.close(fd)
        raise
    return lock_fd, range_lock_fd, committed


def _clear_staging(staging: Path, shards: range, single: bool) -> None:
    """Remove what earlier runs left (a single writer: everything; one of several: its own shards)."""
    if single:
        for entry in os.scandir(staging):
            remove_path(Path(entry.path))
        return
    own = tuple(f"part{k:06d}." for k in shards) + tuple(shard_name(k) for k in shards)
    own += tuple(scales_name(k) for k in shards)
    for name in os.listdir(staging):
        if name.startswith(own):
            remove_path(staging / name)


def derived_files(specs: Mapping[str, StreamSpec], stats: bool) -> dict[str, str]:
    """The files besides shards that finalizing these streams makes: name -> how (a dtype
    and shape, for comparison with a finalized staging directory's manifest)."""
    out: dict[str, str] = {}
    for key, spec in specs.items():
        if key == "acts":
            continue
        kind, _, name = key.partition(".")
        fname = LABELS_FILE if key == "labels" else column_file(name) if kind == "column" else text_file(name)
        out[fname] = "" if spec.dtype is None else f"{spec.dtype.str} {list(spec.tail)}"
    if stats:
        out[STATS_FILE] = ""
    return out


def take_sealed(parts: Parts, shards: range, stop: int, specs: Mapping[str, StreamSpec]) -> int:
    """Take the sealed shards at the start of ``shards`` into ``parts`` (their part info and
    statistics); returns the first example to write (``stop`` when every shard is sealed)."""
    md = parts.md
    sealed = _sealed_records(parts.staging, md, shards, specs, parts.stats is not None)
    for k, record in zip(shards, sealed, strict=False):
        parts.done[k] = {ACTS: record["acts"], **record["streams"]}
        if record.get("scales") is not None:
            parts.done[k][SCALES] = record["scales"]
        if parts.stats is not None:
            parts.stats.shards[k] = StatsAccumulator.from_json(record["stats"], md.n_layers, md.d_model)
    resumed = shards.start + len(sealed)
    return stop if resumed == shards.stop else resumed * md.examples_per_shard


def _sealed_records(
    staging: Path, md: Metadata, shards: range, specs: Mapping[str, StreamSpec], stats: bool
) -> list[dict[str, Any]]:
    """The part records of ``shards``' first shards, up to the first one without a valid
    record for exactly these streams (and statistics, if wanted): where a writer resumes."""
    sealed = []
    for k in shards:
        record = _load_record(staging, md, k)
        if record is None or set(record["streams"]) != set(specs) - {"acts"}:
            break
        if any(
            key != "acts" and record["streams"][key].get("dtype") != spec.to_json().get("dtype")
            for key, spec in specs.items()
        ):
            break
        if stats and record["stats"] is None:
            break
        sealed.append(record)
    return sealed


def _load_record(staging: Path, md: Metadata, k: int) -> dict[str, Any] | None:
    """Shard ``k``'s part record if it and every part it names check out, else None."""
    path = staging / part_record(k)
    try:
        record = strict_json_loads(path.read_bytes())
        if record["n_examples"] != md.shard_n_examples(k):
            return None
        scales = record.get("scales")
        if (scales is not None) != (md.dtype == FLOAT8):
            return None
        published = [(ACTS, record["acts"])] + ([(SCALES, scales)] if scales is not None else [])
        for key, info in [*published, *record["streams"].items()]:
            # The files published as written get their block digests (protocol 3.1) from this
            # pass, whatever the record says: the same bytes, the same digests.
            hasher = BlockHasher(md.rules.block_size if key in (ACTS, SCALES) else None)
            nbytes, digest = hash_file(staging / part_file(k, key), hasher=hasher)
            if nbytes != info["nbytes"] or digest != info["xxh3_128"]:
                return None
            if hasher.block_size is not None:
                info["blocks"] = hasher.block_hexdigests()
        record["stats"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return dict(record)
