"""`finalize`: check every shard's part record, join the per-shard parts, write the
manifest and publish the cache (protocol.md section 6).

The steps (numbered as in protocol.md section 6), and what a kill after each leaves; a
resumed writer, or `finalize` alone, continues from every one of them:
  1. part records checked             -> records and parts intact: finalize again
  2. streams joined, stats.json,      -> removed and made again from the parts
     blocks.json (3.1),
     checksums.json (2.1)
  3. shards.json written              -> the commit point: staging holds the finished cache
  4. part files and records removed   -> the finished cache: re-check it and publish
  5. listing and sizes re-checked
  6. files 0444, folder 0555          -> the same (write permission restored if needed)
  7. renamed to <root>/<HASH>         -> published, complete and read-only
  8. lock file removed                -> (before it: a lock file, removed by the next writer)

Every check finalize makes before it writes anything is in `_validate`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import xxhash

from ..errors import AlreadyPublishedError, Problems, WriterError
from ..fileio import (
    IO_CHUNK,
    BlockHasher,
    fault_point,
    hash_file,
    make_owner_writable,
    make_writable,
    naming_disk_full,
    publish_dir,
    remove_path,
    stream,
    write_all,
    write_file_atomic,
)
from ..protocol.common import (
    BLOCKS_FILE,
    FLOAT8,
    LABELS_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    STATS_FILE,
    XXH3_RE,
    column_file,
    n_blocks,
    scales_name,
    shard_name,
    text_file,
)
from ..protocol.jsonfile import strict_json_loads
from ..protocol.manifest import ArrayEntry, FileEntry, Manifest, ShardEntry, ShardList, TextEntry
from ..protocol.metadata import Metadata
from ..protocol.staging import ACTS, SCALES, is_staging_only, lock_path, part_file, part_record, staging_dir
from ..protocol.v3 import pretty_json
from ..protocol.v31 import blocks_bytes, blocks_entry
from ..statistics import StatsAccumulator
from .staging import already_published, take_writer_lock

_FINALIZE_NOTE = "; every shard is sealed and kept: free some space and finalize again (or resume the writer)"


def finalize(
    root: str | os.PathLike[str],
    md: Metadata,
    *,
    verify: bool = True,
    durable: bool = True,
    _lock_fd: int | None = None,
) -> Path:
    """Check every shard's part record, join the parts, write the manifest and publish.

    Called automatically when a single writer closes. With several writers, call it
    once after every rank has closed; ``verify`` re-reads every part to check its
    digest. Raises `WriterError` naming every missing or broken shard, `WriterBusyError`
    while writers run, `AlreadyPublishedError` once published. Finishes what a killed
    finalize left, from any step.
    """
    root = Path(root)
    staging = staging_dir(root, md)
    final = root / md.hash
    lock_fd = _lock_fd
    if lock_fd is None:
        busy = f"{staging}: writers are still running; finalize after they close"
        lock_fd = take_writer_lock(root, md, shared=False, busy=busy)
    try:
        if final.exists():
            raise already_published(final)
        if not staging.is_dir():
            lock_path(root, md).unlink(missing_ok=True)  # we hold it exclusively (see take_lock)
            raise WriterError(f"nothing to finalize: {staging} does not exist")
        fault_point("finalize-start")
        _finalize_locked(root, md, staging, final, verify, durable)
        # Published: the lock file goes while we still hold it, so nobody can hold a stale one.
        lock_path(root, md).unlink(missing_ok=True)
        fault_point("lock-removed")
        return final
    finally:
        if _lock_fd is None:
            os.close(lock_fd)


def _finalize_locked(root: Path, md: Metadata, staging: Path, final: Path, verify: bool, durable: bool) -> None:
    commit = read_commit(staging, md)
    records = _validate(md, staging, commit, verify)
    make_owner_writable(staging)
    files = _assemble(md, staging, records, durable) if commit is None else commit.files
    for name in os.listdir(staging):
        if is_staging_only(name):
            remove_path(staging / name)
    fault_point("staging-cleaned")
    if not publish_dir(staging, final, durable, expected={name: n for name, (n, _) in files.items()}):
        raise AlreadyPublishedError(f"{final} was published by someone else meanwhile")


#: Problems listed in a finalize error (the rest are counted in its head or left out).
_LISTED = 50


def _validate(md: Metadata, staging: Path, commit: _Commit | None, verify: bool) -> list[dict[str, Any]]:
    """Every check before finalizing: the metadata, then either the committed files'
    digests (``verify``) or every shard's part record and the parts it names. Returns the
    part records (none when ``commit`` is given); raises `WriterError` listing the problems."""
    md_path = staging / METADATA_FILE
    if not md_path.is_file() or md_path.read_bytes() != md.to_bytes():
        raise WriterError(f"{md_path} does not match the metadata being finalized")
    if commit is not None:
        if verify:
            bad = Problems(WriterError, sep="\n  ")
            for name, (_, digest) in sorted(commit.files.items()):
                if digest is not None and (staging / name).is_file() and hash_file(staging / name)[1] != digest:
                    bad.add(f"{staging / name}: xxh3_128 differs from {MANIFEST_FILE}", field=name)
            bad.raise_if_any(f"{staging}: cannot finalize:\n  ", limit=_LISTED)
        return []
    records: list[dict[str, Any]] = []
    incomplete = Problems(WriterError, sep="\n  ")
    for k in range(md.n_shards):
        try:
            records.append(strict_json_loads((staging / part_record(k)).read_bytes()))
        except FileNotFoundError:
            incomplete.add(f"shard {k}: not written (no {part_record(k)})", field=f"shard {k}")
        except (OSError, ValueError) as err:
            incomplete.add(f"shard {k}: unreadable part record ({err})", field=f"shard {k}")
    incomplete.raise_if_any(f"{staging}: cannot finalize, {len(incomplete)} shards incomplete:\n  ", limit=_LISTED)
    stream_sets = {tuple(sorted(r["streams"])) for r in records}
    if len(stream_sets) > 1:
        raise WriterError(f"{staging}: shards were written with different streams: {sorted(stream_sets)}")
    files = Problems(WriterError, sep="\n  ")
    block_size = md.rules.block_size
    for r in records:
        k = r["shard"]
        if md.dtype == FLOAT8 and r.get("scales") is None:
            files.add(f"shard {k}: its part record lists no scales", field=f"shard {k}")
            continue
        for key, info in [("acts", r["acts"]), *_scales(r), *r["streams"].items()]:
            path = staging / part_file(k, key)
            size = path.stat().st_size if path.exists() else -1
            # Protocol 3.1: the files published as written carry their block digests; a record
            # without them (or with the wrong number) has them computed from the file now.
            blocks_due = block_size is not None and key in (ACTS, SCALES)
            missing_blocks = blocks_due and not _has_blocks(info, size, block_size)
            if size != info["nbytes"]:
                files.expected(str(path), f"{info['nbytes']} bytes", str(size) if size >= 0 else "no file")
            elif verify or missing_blocks:
                hasher = BlockHasher(block_size if blocks_due else None)
                if hash_file(path, hasher=hasher)[1] != info["xxh3_128"]:
                    files.add(f"{path}: xxh3_128 differs from its part record", field=str(path))
                elif blocks_due:
                    info["blocks"] = hasher.block_hexdigests()
        if r["acts"]["nbytes"] != md.shard_nbytes(k):
            files.add(
                f"shard {k}: expected {md.shard_nbytes(k)} bytes, record says {r['acts']['nbytes']}", field=f"shard {k}"
            )
        if md.dtype == FLOAT8 and r["scales"]["nbytes"] != md.shard_scales_nbytes(k):
            files.add(
                f"shard {k}: expected {md.shard_scales_nbytes(k)} bytes of scales, record says {r['scales']['nbytes']}",
                field=f"shard {k}",
            )
    files.raise_if_any(f"{staging}: cannot finalize:\n  ", limit=_LISTED)
    for key, info in records[0]["streams"].items() if records else ():
        if any(
            r["streams"][key].get("dtype") != info.get("dtype") or r["streams"][key].get("shape") != info.get("shape")
            for r in records
        ):
            raise WriterError(f"{staging}: stream {key!r} has different dtypes or shapes across shards")
    return records


def _assemble(
    md: Metadata, staging: Path, records: list[dict[str, Any]], durable: bool
) -> dict[str, tuple[int, str | None]]:
    """Steps 2-3, from checked part records: join the streams, write stats.json and the
    manifest (shards.json last: its presence means every file is complete). Returns every
    file to publish: name -> (nbytes, xxh3_128 or None)."""
    for name in os.listdir(staging):
        if _is_derived(name, md):  # from a finalize killed before its commit point
            remove_path(staging / name)
    fault_point("finalize-checked")

    shards = ShardList.of(
        ShardEntry(shard_name(r["shard"]), r["n_examples"], r["acts"]["nbytes"], r["acts"]["xxh3_128"]) for r in records
    )
    scales = None
    if md.dtype == FLOAT8:
        scales = ShardList.of(
            ShardEntry(scales_name(r["shard"]), r["n_examples"], r["scales"]["nbytes"], r["scales"]["xxh3_128"])
            for r in records
        )
    # Protocol 3.1: the block digests of every file, from the records for the files published
    # as written, computed while joining for the others.
    block_size = md.rules.block_size
    blocks: dict[str, list[str]] = {}
    if block_size is not None:
        for r in records:
            blocks[shard_name(r["shard"])] = r["acts"]["blocks"]
            if scales is not None:
                blocks[scales_name(r["shard"])] = r["scales"]["blocks"]
    labels, columns, text = _join_streams(md, staging, records, durable, blocks)
    stats_entry = _write_stats(md, staging, records, durable, blocks)
    empty = ShardList.of(_write_empty_shard(staging, md, name, durable) for name in _empty_shard_names(md))
    manifest = Manifest(
        shards=shards, labels=labels, columns=columns, text=text, stats=stats_entry, empty_shards=empty, scales=scales
    )
    if block_size is not None:  # blocks.json, before shards.json: it commits it
        data = blocks_bytes(block_size, blocks)
        write_file_atomic(staging / BLOCKS_FILE, data, durable, note=_FINALIZE_NOTE)
        manifest = dataclasses.replace(manifest, blocks=blocks_entry(data))
        fault_point("blocks-written")
    files: dict[str, tuple[int, str | None]] = dict(
        (name, (nbytes, digest)) for name, nbytes, digest in manifest.files()
    )
    files[METADATA_FILE] = ((staging / METADATA_FILE).stat().st_size, None)
    sidecars = md.rules.sidecars(manifest, md)
    for name, data in sidecars.items():  # before shards.json: it commits what they say
        write_file_atomic(staging / name, data, durable, note=_FINALIZE_NOTE)
        files[name] = (len(data), None)
    if sidecars:
        fault_point("checksums-written")
    manifest_bytes = md.rules.manifest_bytes(manifest, md)
    write_file_atomic(staging / MANIFEST_FILE, manifest_bytes, durable, note=_FINALIZE_NOTE)  # the commit point
    files[MANIFEST_FILE] = (len(manifest_bytes), None)
    fault_point("manifest-written")
    return files


def _join_streams(
    md: Metadata, staging: Path, records: list[dict[str, Any]], durable: bool, blocks: dict[str, list[str]]
) -> tuple[ArrayEntry | None, dict[str, ArrayEntry], dict[str, TextEntry]]:
    """Step 2: every stream's parts joined into its file (labels, columns, text), their block
    digests added to ``blocks`` (protocol 3.1)."""
    labels = None
    columns: dict[str, ArrayEntry] = {}
    text: dict[str, TextEntry] = {}
    for i, key in enumerate(sorted(records[0]["streams"]) if records else []):
        info = records[0]["streams"][key]
        total = sum(r["streams"][key]["nbytes"] for r in records)
        if key == "labels":
            nbytes, digest = _join(staging, md, key, LABELS_FILE, durable, total, blocks)
            labels = ArrayEntry(LABELS_FILE, info["dtype"], (md.n_examples, *info["shape"]), nbytes, digest)
        elif key.startswith("column."):
            name = key.split(".", 1)[1]
            nbytes, digest = _join(staging, md, key, column_file(name), durable, total, blocks)
            columns[name] = ArrayEntry(
                column_file(name), info["dtype"], (md.n_examples, *info["shape"]), nbytes, digest
            )
        else:
            name = key.split(".", 1)[1]
            nbytes, digest = _join(staging, md, key, text_file(name), durable, total, blocks)
            text[name] = TextEntry(text_file(name), md.n_examples, nbytes, digest)
        fault_point("joined", i)
    return labels, columns, text


def _write_stats(
    md: Metadata, staging: Path, records: list[dict[str, Any]], durable: bool, blocks: dict[str, list[str]]
) -> FileEntry | None:
    """Step 3's stats.json, summed from the parts' statistics (None when a part has none)."""
    if not records or any(r["stats"] is None for r in records):
        return None
    total_stats = StatsAccumulator(md.n_layers, md.d_model)
    for r in records:  # shard order: the sums are the same for any number of writers
        total_stats.add(StatsAccumulator.from_json(r["stats"], md.n_layers, md.d_model))
    data = pretty_json(total_stats.summary(md.layers))
    write_file_atomic(staging / STATS_FILE, data, durable, note=_FINALIZE_NOTE)
    block_size = md.rules.block_size
    if block_size is not None:
        hasher = BlockHasher(block_size)
        hasher.update(data)
        blocks[STATS_FILE] = hasher.block_hexdigests()
    fault_point("stats-written")
    return FileEntry(STATS_FILE, len(data), xxhash.xxh3_128_hexdigest(data))


class _Commit:
    """What a finalized staging directory holds (its shards.json, and the dialect's sidecars)."""

    def __init__(self, files: dict[str, tuple[int, str | None]], derived: dict[str, str]) -> None:
        #: Every file to publish: name -> (nbytes, xxh3_128 or None for the JSON files).
        self.files = files
        #: Files besides shards and JSON, as `resume.derived_files` describes them.
        self.derived = derived


def read_commit(staging: Path, md: Metadata) -> _Commit | None:
    """The finished cache in ``staging`` if finalizing reached its commit point (shards.json
    written) and it lists exactly ``md``'s shards, each with its digest; else None (nothing
    committed)."""
    try:
        manifest, problems = md.rules.load_manifest(staging, md)
        if manifest is None or problems:
            return None
        files: dict[str, tuple[int, str | None]] = {
            name: (os.lstat(staging / name).st_size, None)
            for name in (METADATA_FILE, MANIFEST_FILE, *md.rules.sidecar_names)
        }
    except (OSError, ValueError):
        return None
    listed = manifest.files()
    files.update((name, (nbytes, digest)) for name, nbytes, digest in listed)
    derived: dict[str, str] = {}
    arrays = [*manifest.columns.values(), *([manifest.labels] if manifest.labels else [])]
    derived.update((a.name, f"{a.dtype} {list(a.shape[1:])}") for a in arrays)
    derived.update((t.name, "") for t in manifest.text.values())
    if manifest.stats is not None:
        derived[STATS_FILE] = ""
    expected = [(shard_name(k), md.shard_n_examples(k), md.shard_nbytes(k)) for k in range(md.n_shards)]
    if list(zip(manifest.shards.names, manifest.shards.counts, manifest.shards.sizes, strict=True)) != expected:
        return None
    if list(manifest.empty_shards.names) != _empty_shard_names(md):
        return None
    if md.dtype == FLOAT8:
        want_scales = [(scales_name(k), md.shard_scales_nbytes(k)) for k in range(md.n_shards)]
        if (
            manifest.scales is None
            or list(zip(manifest.scales.names, manifest.scales.sizes, strict=True)) != want_scales
        ):
            return None
    if any(digest is None for _, _, digest in listed):  # 2.1: checksums.json must list every file
        return None
    return _Commit(files, derived)


def _empty_shard_names(md: Metadata) -> list[str]:
    """The all-zero shard files the dialect's writer leaves after the last shard (protocol.md 9)."""
    return [shard_name(md.n_shards + i) for i in range(md.rules.empty_shards(md))]


def _is_derived(name: str, md: Metadata) -> bool:
    """Files finalizing makes from the parts (and may make again): joins, stats, empty shards,
    the manifest and its sidecars."""
    return (
        name in (LABELS_FILE, STATS_FILE, BLOCKS_FILE, MANIFEST_FILE, *md.rules.sidecar_names, *_empty_shard_names(md))
        or (name.startswith("column.") and name.endswith(".bin"))
        or (name.startswith("text.") and name.endswith(".jsonl"))
    )


def unfinalize(staging: Path, md: Metadata) -> None:
    """Take a finalized staging directory back to its shards and part records (restoring
    write permission: a killed finalize may have frozen it)."""
    make_writable(staging)
    for name in os.listdir(staging):
        if _is_derived(name, md):
            remove_path(staging / name)


def _write_empty_shard(staging: Path, md: Metadata, name: str, durable: bool) -> ShardEntry:
    """An all-zero, full-size shard file listed with ``n_examples`` 0, as saev's writer leaves one."""
    nbytes = md.examples_per_shard * md.example_nbytes
    h = BlockHasher()
    zeros = memoryview(bytes(min(nbytes, IO_CHUNK)))
    path = staging / name
    with naming_disk_full(path, nbytes, _FINALIZE_NOTE), open(path, "wb", buffering=0) as out:
        left = nbytes
        while left:
            piece = zeros[: min(left, IO_CHUNK)]
            write_all(out, piece)
            h.update(piece)
            left -= len(piece)
        if durable:
            os.fsync(out.fileno())
    return ShardEntry(name, 0, nbytes, h.hexdigest())


def _has_blocks(info: dict[str, Any], nbytes: int, block_size: int | None) -> bool:
    """Whether a part record's entry lists the digests of every block of a file of ``nbytes``."""
    blocks = info.get("blocks")
    return (
        block_size is not None
        and isinstance(blocks, list)
        and len(blocks) == n_blocks(nbytes, block_size)
        and all(isinstance(b, str) and XXH3_RE.fullmatch(b) for b in blocks)
    )


def _scales(record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The scales part of a float8_e4m3 cache's part record, as ``[(stream, info)]`` ([] for other dtypes)."""
    info = record.get("scales")
    return [] if info is None else [(SCALES, info)]


def _join(
    staging: Path, md: Metadata, key: str, name: str, durable: bool, expected: int, blocks: dict[str, list[str]]
) -> tuple[int, str]:
    """Concatenate stream ``key``'s per-shard parts, in shard order, into ``name``; ``(nbytes,
    digest)``. With a block size (protocol 3.1) the digests of its blocks go to ``blocks[name]``,
    computed as it is written."""
    h = BlockHasher(md.rules.block_size)
    total = 0
    out_path = staging / name
    buffer = memoryview(bytearray(IO_CHUNK))
    with naming_disk_full(out_path, expected, _FINALIZE_NOTE), open(out_path, "wb", buffering=0) as out:
        for k in range(md.n_shards):
            with open(staging / part_file(k, key), "rb", buffering=0) as f:
                total += stream(f, out, h, buffer=buffer)
        if durable:
            os.fsync(out.fileno())
    if md.rules.block_size is not None:
        blocks[name] = h.block_hexdigests()
    return total, h.hexdigest()
