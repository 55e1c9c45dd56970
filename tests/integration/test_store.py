"""The shard store: roots, hash/prefix resolution, listings, verified staging, runs and doctor."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

import saev_shards as ss
from saev_shards import store

from ..support.caches import colliding_metadata, small_metadata, tree_bytes, writable_copy, write_cache

ENV_VARS = (
    store.SHARDS_ROOT_ENV,
    store.RUNS_ROOT_ENV,
    store.STAGE_ROOT_ENV,
    store.SCRATCH_ENV,
    store.NFS_ENV,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


# --------------------------------------------------------------------------------------
# roots


def test_roots_argument_beats_own_variable_beats_shared_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ss.RootNotSetError, match=r"SAEV_SHARDS_ROOT.*SAEV_SCRATCH"):
        store.shards_roots()
    with pytest.raises(ss.RootNotSetError, match=r"SAEV_RUNS_ROOT.*SAEV_NFS"):
        store.runs_root()
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("SAEV_NFS", str(tmp_path / "nfs"))
    assert store.shards_roots() == [store.Root(tmp_path / "scratch/saev/shards", "SAEV_SCRATCH")]
    assert store.runs_root() == store.Root(tmp_path / "nfs/saev/runs", "SAEV_NFS")
    monkeypatch.setenv("SAEV_SHARDS_ROOT", f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}{os.pathsep}")
    monkeypatch.setenv("SAEV_RUNS_ROOT", str(tmp_path / "runs"))
    assert [r.path for r in store.shards_roots()] == [tmp_path / "a", tmp_path / "b"]
    assert store.shards_roots()[0].source == "SAEV_SHARDS_ROOT"
    assert store.runs_root().path == tmp_path / "runs"
    assert store.shards_roots(tmp_path / "x") == [store.Root(tmp_path / "x", "argument")]
    assert [r.path for r in store.shards_roots([tmp_path / "x", str(tmp_path / "y")])] == [
        tmp_path / "x",
        tmp_path / "y",
    ]
    assert store.runs_root(tmp_path / "r").path == tmp_path / "r"
    (tmp_path / "tmp").mkdir()  # gettempdir() takes TMPDIR only when it is a writable folder
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    assert store.stage_root().path == tmp_path / "tmp/saev/shards"
    monkeypatch.setenv("SAEV_STAGE_ROOT", str(tmp_path / "local"))
    assert store.stage_root().path == tmp_path / "local"


# --------------------------------------------------------------------------------------
# resolution


def test_resolve_path_full_hash_and_unique_prefix(root: Path, make_cache: Any, monkeypatch: pytest.MonkeyPatch):
    shards, _ = make_cache()
    h = shards.metadata.hash
    assert store.resolve(shards.path, root) == shards.path
    assert store.resolve(h, root) == shards.path
    assert store.resolve(h[:4], root) == shards.path
    assert store.resolve(h[:9].upper(), [root]) == shards.path
    # open() takes the same references; the environment supplies the root.
    monkeypatch.setenv("SAEV_SHARDS_ROOT", str(root))
    assert ss.open(h[:6]).path == shards.path
    assert ss.open(h).path == shards.path
    # An existing path always wins, even one that looks like a prefix.
    monkeypatch.chdir(root.parent)
    decoy = root.parent / h[:6]
    shutil.copytree(shards.path, decoy)
    with pytest.raises(ss.HashMismatchError):
        ss.open(h[:6])  # the folder named like the prefix, whose name is not its hash


def test_resolve_errors_say_what_was_searched(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache()
    h = shards.metadata.hash
    with pytest.raises(ss.CacheRefError, match=r"too short: expected at least 4 hex digits, found 3"):
        store.resolve(h[:3], root)
    unknown = "0000" if not h.startswith("0000") else "ffff"
    with pytest.raises(ss.UnknownCacheError) as info:
        store.resolve(unknown, [root, tmp_path / "nowhere"])
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, ss.CacheNotFoundError)
    message = str(info.value)
    assert f"no cache matches hash prefix '{unknown}' in {root} (argument)" in message
    assert f"{tmp_path / 'nowhere'} (argument) [does not exist]" in message
    with pytest.raises(ss.UnknownCacheError, match=r"not a hash or hash prefix"):
        store.resolve("my-cache", root)
    with pytest.raises(ss.UnknownCacheError, match=r"no such file or directory$"):
        store.resolve(tmp_path / "missing" / h, root)
    # No root at all: still a not-found error, naming the variables to set.
    with pytest.raises(ss.UnknownCacheError, match=r"no shards root to look up the hash prefix.*SAEV_SHARDS_ROOT"):
        store.resolve(h[:8])
    with pytest.raises(ss.UnknownCacheError, match=r"no shards root to look up the hash"):
        ss.open(h)


def test_unpublished_folders_never_match_but_are_hinted(root: Path):
    md = small_metadata()
    w = ss.ShardWriter(root, md, durable=False)
    w.write(write_source(md)[:5])  # a writer still open: its staging folder exists
    try:
        with pytest.raises(ss.UnknownCacheError, match=r"unpublished \(being written, or interrupted\): .*\.staging-"):
            store.resolve(md.hash[:6], root)
        assert store.list_caches(root) == []
        assert store.list_unpublished(root) == [root / f".staging-{md.hash}"]
    finally:
        w.abort()


def write_source(md: ss.Metadata) -> Any:
    from ..support.caches import float_input, logical_tensor

    return float_input(md, logical_tensor(md))


def test_ambiguous_prefix_lists_every_candidate_with_its_root(tmp_path: Path):
    a, b = colliding_metadata()
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    write_cache(root_a, a)
    write_cache(root_b, b)
    prefix = a.hash[:4]
    with pytest.raises(ss.AmbiguousPrefixError) as info:
        store.resolve(prefix, [root_a, root_b])
    message = str(info.value)
    assert f"hash prefix '{prefix}' is ambiguous: 2 caches match" in message
    assert f"{a.hash} in {root_a}" in message
    assert f"{b.hash} in {root_b}" in message
    assert sorted(info.value.candidates) == sorted([str(root_a / a.hash), str(root_b / b.hash)])
    # One more digit tells them apart.
    n = next(i for i in range(4, 64) if a.hash[i] != b.hash[i]) + 1
    assert store.resolve(a.hash[:n], [root_a, root_b]) == root_a / a.hash
    # The same hash in two roots is the same content: the first root's copy, no ambiguity.
    write_cache(root_b, a)
    assert store.resolve(a.hash[:n], [root_b, root_a]) == root_b / a.hash


# --------------------------------------------------------------------------------------
# listing and removing


def test_list_caches_opens_each_and_skips_what_is_not_a_cache(root: Path, make_cache: Any, tmp_path: Path):
    good, _ = make_cache()
    other = small_metadata(n_examples=7)
    write_cache(root, other)
    broken = writable_copy(root / other.hash, tmp_path)
    store.remove(root / other.hash)
    os.unlink(broken / "acts000001.bin")
    shutil.move(broken, root / other.hash)
    (root / "not-a-cache").mkdir()
    (root / ".copying-abc").mkdir()
    entries = store.list_caches(root)
    assert [e.hash for e in entries] == sorted([good.metadata.hash, other.hash])
    by_hash = {e.hash: e for e in entries}
    assert by_hash[good.metadata.hash].ok
    assert by_hash[good.metadata.hash].n_shards == 5
    assert by_hash[good.metadata.hash].nbytes == sum(p.stat().st_size for p in good.path.iterdir())
    bad = by_hash[other.hash]
    assert not bad.ok
    assert bad.problem is not None and "acts000001.bin: missing" in bad.problem
    assert bad.metadata == other  # still shown, from metadata.json
    assert store.list_unpublished(root) == [root / ".copying-abc"]


def test_remove_undoes_read_only_modes_and_refuses_other_folders(root: Path, make_cache: Any):
    shards, _ = make_cache()
    assert stat.S_IMODE(shards.path.stat().st_mode) == 0o555
    keep = root / "datasets"
    keep.mkdir()
    with pytest.raises(ss.CacheRefError, match=r"refusing to remove .*datasets.*found the name 'datasets'"):
        store.remove(keep)
    assert keep.is_dir()
    # Open here: this process holds the cache's lock.
    with pytest.raises(
        ss.CacheInUseError, match=r"in use by 1 process: pid \d+ \(this process\) .*holds the cache's lock"
    ):
        store.remove(shards.path)
    shards.close()  # releases it
    store.remove(shards.path)
    assert not shards.path.exists()
    with pytest.raises(ss.UnknownCacheError):
        store.remove(shards.path)


# --------------------------------------------------------------------------------------
# staging


def test_stage_makes_a_verified_read_only_identical_copy(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache(labels=True, text=True, stats=True)
    local = tmp_path / "local"
    copy = store.stage(shards.metadata.hash[:6], local, roots=root)
    assert copy.path == local / shards.metadata.hash
    assert tree_bytes(copy.path) == tree_bytes(shards.path)
    assert stat.S_IMODE(copy.path.stat().st_mode) == 0o555
    assert {stat.S_IMODE(p.stat().st_mode) for p in copy.path.iterdir()} == {0o444}
    assert os.listdir(local) == [shards.metadata.hash]  # no partial folder left behind
    copy.verify()
    again = store.copy_cache(shards.path, local)
    assert again.already_staged and again.copied_files == 0


def test_stage_interrupted_then_resumed_reverifies_what_is_there(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache(labels=True, stats=True)
    local = tmp_path / "local"
    files = shards.manifest.files()
    stop_after = sum(n for _, n, _ in files[:3])  # interrupt once three files are copied

    seen = 0

    def interrupt(n: int) -> None:
        nonlocal seen
        seen += n
        if seen >= stop_after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.copy_cache(shards.path, local, on_bytes=interrupt)
    partial = local / f".copying-{shards.metadata.hash}"
    assert not (local / shards.metadata.hash).exists()
    assert sorted(os.listdir(partial)) == [name for name, _, _ in files[:3]]
    # What an interrupted copy may leave: a half-written file, a complete one gone bad, junk.
    half = partial / files[1][0]
    half.write_bytes(half.read_bytes()[: files[1][1] // 2])
    bad = partial / files[2][0]
    data = bytearray(bad.read_bytes())
    data[7] ^= 0xFF
    bad.write_bytes(bytes(data))
    (partial / "metadata.json.123.tmp").write_bytes(b"{")

    report = store.copy_cache(shards.path, local)
    assert report.kept_files == 1  # files[0], re-hashed
    assert report.resumed_files == 1  # files[1], completed from the middle
    assert report.recopied == [files[2][0]]
    assert report.copied_files == len(files) - 2
    assert report.kept_bytes == files[0][1] + files[1][1] // 2
    assert tree_bytes(local / shards.metadata.hash) == tree_bytes(shards.path)
    assert not partial.exists()
    ss.open(local / shards.metadata.hash).verify()


def test_stage_resume_recopies_a_half_written_file_whose_start_is_wrong(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache()
    local = tmp_path / "local"
    partial = local / f".copying-{shards.metadata.hash}"
    partial.mkdir(parents=True)
    name, nbytes, _ = shards.manifest.files()[0]
    (partial / name).write_bytes(b"\x01" * (nbytes // 2))
    report = store.copy_cache(shards.path, local)
    assert report.recopied == [name] and report.resumed_files == 0
    assert tree_bytes(local / shards.metadata.hash) == tree_bytes(shards.path)


def test_stage_refuses_a_source_that_fails_its_own_checksums(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache()
    damaged_root = tmp_path / "damaged"
    damaged_root.mkdir()
    src = writable_copy(shards.path, damaged_root)
    data = bytearray((src / "acts000002.bin").read_bytes())
    data[0] ^= 0x01  # same size: only a checksum can tell
    (src / "acts000002.bin").write_bytes(bytes(data))
    local = tmp_path / "local"
    with pytest.raises(ss.ChecksumMismatchError) as info:
        store.stage(src, local)
    assert str(info.value).startswith(f"{src / 'acts000002.bin'}: xxh3_128 expected ")
    assert "the source cache is damaged" in str(info.value)
    assert not (local / shards.metadata.hash).exists()


def test_stage_repairs_a_local_copy_a_scratch_purge_damaged(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache()
    local = tmp_path / "local"
    copy = store.stage(shards.path, local)
    os.chmod(copy.path, 0o755)
    (copy.path / "acts000004.bin").unlink()
    os.chmod(copy.path, 0o555)
    with pytest.raises(ss.CacheNotFoundError):
        ss.open(copy.path)
    # While a reader holds the damaged copy, it is neither renamed nor repaired under it.
    with pytest.raises(ss.CacheInUseError, match=r"in use by 1 process: pid \d+ \(this process\)"):
        store.copy_cache(shards.path, local)
    assert (local / shards.metadata.hash).is_dir()
    copy.close()
    report = store.copy_cache(shards.path, local)
    listed = len(shards.manifest.files())  # 5 shards and blocks.json
    assert report.repaired and report.kept_files == listed - 1 and report.copied_files == 1
    ss.open(copy.path).verify()
    assert stat.S_IMODE(copy.path.stat().st_mode) == 0o555


def test_stage_refuses_while_another_process_copies(root: Path, make_cache: Any, tmp_path: Path):
    shards, _ = make_cache()
    partial = tmp_path / "local" / f".copying-{shards.metadata.hash}"
    partial.mkdir(parents=True)
    fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(ss.WriterBusyError, match=r"another process is copying"):
            store.copy_cache(shards.path, tmp_path / "local")
    finally:
        os.close(fd)
    store.copy_cache(shards.path, tmp_path / "local")  # the lock went with its holder


# --------------------------------------------------------------------------------------
# runs


@pytest.fixture
def run_setup(root: Path, tmp_path: Path) -> dict[str, Any]:
    train_md, val_md = small_metadata(), small_metadata(n_examples=7)
    write_cache(root, train_md)
    write_cache(root, val_md)
    datasets = {name: tmp_path / "data" / name for name in ("train", "val")}
    for p in datasets.values():
        p.mkdir(parents=True)
    return {"root": root, "runs": tmp_path / "runs", "train": train_md, "val": val_md, "datasets": datasets}


def make_run(s: dict[str, Any], run_id: str = "sae-16k") -> store.Run:
    return store.create_run(
        s["train"].hash[:6],
        s["val"].hash[:6],
        run_id=run_id,
        runs_root=s["runs"],
        roots=s["root"],
        train_dataset=s["datasets"]["train"],
        val_dataset=s["datasets"]["val"],
    )


def levels(findings: list[store.Finding]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in findings:
        out.setdefault(f.level, []).append(f"{f.subject}: {f.message}")
    return out


def test_create_run_lays_out_links_and_checkpoint(run_setup: dict[str, Any]):
    s = run_setup
    run = make_run(s)
    assert run.path == s["runs"] / "sae-16k"
    assert sorted(os.listdir(run.path)) == ["checkpoint", "inference", "links"]  # saev's Run needs all three
    assert sorted(os.listdir(run.links_dir)) == sorted(store.LINK_NAMES)
    assert all((run.links_dir / n).is_symlink() for n in store.LINK_NAMES)
    assert run.train_shards == s["root"] / s["train"].hash
    assert run.val_shards == s["root"] / s["val"].hash
    assert run.train_dataset == s["datasets"]["train"]
    assert run.val_dataset == s["datasets"]["val"]
    assert run.sae_checkpoint == run.path / "checkpoint" / "sae.pt"
    assert run.checkpoint_config == run.path / "checkpoint" / "config.json"
    assert run.inference_dir(s["val"].hash) == run.path / "inference" / s["val"].hash
    assert run.open_train().metadata == s["train"]
    assert run.open_val().metadata == s["val"]
    # --run accepts the path, or a bare id in the runs root.
    assert store.open_run(run.path) == run
    assert store.open_run("sae-16k", s["runs"]) == run
    with pytest.raises(ss.RunExistsError, match=r"already exists"):
        make_run(s)
    with pytest.raises(ss.RunError, match=r"bad run id '\.hidden'"):
        make_run(s, ".hidden")
    with pytest.raises(ss.RunNotFoundError, match=r"no run folder at .*nope nor .*runs/nope"):
        store.open_run("nope", s["runs"])


def test_create_run_links_the_recorded_dataset_only_when_it_is_a_path_here(run_setup: dict[str, Any]):
    s = run_setup
    run = store.create_run(s["train"].hash, runs_root=s["runs"], roots=s["root"])
    assert run.id.endswith(s["train"].hash[:8])
    assert not os.path.lexists(run.link("val-shards"))
    with pytest.raises(ss.RunError, match=r"val-shards: missing"):
        _ = run.val_shards
    # /data/synthetic does not exist on this machine: no dangling link, and doctor passes.
    assert not os.path.lexists(run.link("train-dataset"))
    why = r"\(the cache's dataset /data/synthetic does not exist here; training needs only the shards\)"
    with pytest.raises(ss.RunError, match=rf"train-dataset: missing {why}; .* run init --train-dataset PATH"):
        _ = run.train_dataset
    found = levels(store.doctor(run))
    assert "error" not in found and "warning" not in found
    assert "links/train-dataset: not linked: the cache's dataset /data/synthetic does not exist here " \
        "(training needs only the shards)" in found["note"]  # fmt: skip
    # A dataset recorded as a name (a text dump's python-stdlib-3.11.7) is never a link.
    named = small_metadata(dataset="python-stdlib-3.11.7", n_examples=4)
    write_cache(s["root"], named)
    run = store.create_run(named.hash, runs_root=s["runs"], roots=s["root"], run_id="named")
    assert not os.path.lexists(run.link("train-dataset"))
    assert store.dataset_target(named) == (None, "the cache's dataset 'python-stdlib-3.11.7' is a name, not a path")
    # One that exists here is linked, a folder or a file (a text dump's texts.jsonl).
    texts = s["datasets"]["train"] / "texts.jsonl"
    texts.write_text('{"text": "a"}\n')
    from_file = small_metadata(dataset=str(texts), n_examples=5)
    write_cache(s["root"], from_file)
    run = store.create_run(from_file.hash, runs_root=s["runs"], roots=s["root"], run_id="file")
    assert run.train_dataset == texts
    assert set(levels(store.doctor(run))) == {"ok", "note"}
    # Given explicitly, a dataset link is made even when its target is absent here: doctor calls it dangling.
    absent = s["datasets"]["train"].parent / "elsewhere"
    run = store.create_run(from_file.hash, runs_root=s["runs"], roots=s["root"], run_id="given", train_dataset=absent)
    assert os.readlink(run.link("train-dataset")) == str(absent)
    assert levels(store.doctor(run))["error"] == [
        f"links/train-dataset: dangling: points to {absent}, which does not exist"
    ]
    # docs/store.md says these rules (it said the default link was made for an absent path, and a
    # missing train-dataset or a file link were errors).
    docs = " ".join((Path(__file__).resolve().parents[2] / "docs" / "store.md").read_text().split())
    assert "linked even when that path is absent here (`doctor` then reports the link dangling)" in docs
    assert "only when that is an absolute path that exists on this machine (a folder, or the one file" in docs
    assert "neither a folder nor a regular file" in docs and "a dataset link missing though the cache's dataset" in docs
    assert "created even when that path does not exist" not in docs and "`train-dataset` missing" not in docs


def test_create_run_warns_at_init_about_what_training_relies_on(run_setup: dict[str, Any]):
    s = run_setup
    wide = small_metadata(d_model=16, n_examples=3)
    write_cache(s["root"], wide)
    with pytest.warns(ss.RunWarning, match=r"train and val caches differ: d_model 8 vs 16"):
        store.create_run(s["train"].hash, wide.hash, run_id="wide", runs_root=s["runs"], roots=s["root"])
    with pytest.warns(ss.RunWarning, match=r"the val cache is the train cache"):
        store.create_run(s["train"].hash, s["train"].hash, run_id="twice", runs_root=s["runs"], roots=s["root"])


def test_doctor_passes_a_healthy_run(run_setup: dict[str, Any]):
    run = make_run(run_setup)
    found = levels(store.doctor(run, verify=True))
    assert "error" not in found and "warning" not in found
    assert len(found["ok"]) == 4
    assert found["note"] == [
        "checkpoint/sae.pt: not written yet (the run has not been trained)",
        "checkpoint/config.json: not written yet (the run has not been trained)",
    ]
    (run.checkpoint_dir / "sae.pt").write_bytes(b"weights")
    (run.checkpoint_dir / "config.json").write_bytes(b"{}")
    found = levels(store.doctor(run, require_checkpoint=True))
    assert set(found) == {"ok"} and len(found["ok"]) == 6


def test_doctor_reports_every_broken_or_dangling_thing(run_setup: dict[str, Any], tmp_path: Path):
    s = run_setup
    run = make_run(s)
    shutil.rmtree(s["datasets"]["val"])  # the val dataset link now dangles
    (run.links_dir / "train-shards").unlink()  # a required link is gone
    (run.links_dir / "probe-data").symlink_to(tmp_path / "gone")  # an extra link that dangles
    (run.checkpoint_dir / "config.json").write_bytes(b"")
    found = levels(store.doctor(run, require_checkpoint=True))
    assert found["error"] == [
        "links/train-shards: missing",
        f"links/val-dataset: dangling: points to {s['datasets']['val']}, which does not exist",
        f"links/probe-data: dangling: points to {tmp_path / 'gone'}, which does not exist",
        "checkpoint/sae.pt: missing",
        "checkpoint/config.json: empty file",
    ]


def test_doctor_checks_the_caches_behind_the_links(run_setup: dict[str, Any], tmp_path: Path):
    s = run_setup
    run = make_run(s)
    # Point val-shards at a damaged copy (a byte flipped: only --verify sees it),
    # and train-shards at a copy with a truncated shard (open sees it).
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    val_copy = writable_copy(s["root"] / s["val"].hash, damaged)
    data = bytearray((val_copy / "acts000000.bin").read_bytes())
    data[3] ^= 0x10
    (val_copy / "acts000000.bin").write_bytes(bytes(data))
    other = tmp_path / "other"
    other.mkdir()
    train_copy = writable_copy(s["root"] / s["train"].hash, other)
    with open(train_copy / "acts000001.bin", "r+b") as f:
        f.truncate(10)
    for name, target in (("val-shards", val_copy), ("train-shards", train_copy)):
        (run.links_dir / name).unlink()
        (run.links_dir / name).symlink_to(target)
    quick = levels(store.doctor(run))
    assert len(quick["error"]) == 1
    assert quick["error"] == [
        f"links/train-shards: -> {train_copy}: not a valid cache: "
        "acts000001.bin: expected 800 bytes, found 10 (file seems not fully written?)"
    ]
    thorough = levels(store.doctor(run, verify=True))
    assert len(thorough["error"]) == 2
    assert thorough["error"][1].startswith(f"links/val-shards: -> {val_copy}: verification failed: acts000000.bin: ")
    assert "xxh3_128 expected" in thorough["error"][1]


def test_doctor_warns_about_mismatched_train_and_val_and_real_folders(run_setup: dict[str, Any], tmp_path: Path):
    s = run_setup
    other = small_metadata(d_model=16, n_examples=3)
    write_cache(s["root"], other)
    with pytest.warns(ss.RunWarning, match=r"d_model 8 vs 16"):
        run = store.create_run(s["train"].hash, other.hash, run_id="r", runs_root=s["runs"], roots=s["root"],
                               train_dataset=s["datasets"]["train"], val_dataset=s["datasets"]["val"])  # fmt: skip
    (run.links_dir / "train-dataset").unlink()
    (run.links_dir / "train-dataset").mkdir()
    found = levels(store.doctor(run))
    assert "error" not in found
    assert found["warning"] == [
        "links/train-dataset: not a symlink; runs should link to the one shared copy",
        "links/val-shards: train and val caches differ: d_model 8 vs 16",
    ]


def test_run_reads_the_seed_link_names_as_aliases(run_setup: dict[str, Any], tmp_path: Path):
    s = run_setup
    path = tmp_path / "old-run"
    (path / "links").mkdir(parents=True)
    (path / "checkpoint").mkdir()
    (path / "links" / "shards").symlink_to(s["root"] / s["train"].hash)
    (path / "links" / "dataset").symlink_to(s["datasets"]["train"])
    run = store.open_run(path)
    assert run.train_shards == s["root"] / s["train"].hash
    assert run.train_dataset == s["datasets"]["train"]
    found = levels(store.doctor(run))
    assert "error" not in found
    assert any(m.startswith("links/shards: -> ") for m in found["ok"])


def test_stage_copies_a_reference_cache_whole(root: Path, tmp_path: Path):
    """Protocol 2.1 as saev's writer writes it: no checksums, a trailing empty shard."""
    md = small_metadata(protocol="2.1", dtype="float32", n_examples=20, data="x")  # exactly 4 full shards
    with pytest.warns(ss.ProtocolWarning, match="saev/shards"):  # the root is not .../saev/shards
        write_cache(root, md)
    src = writable_copy(root / md.hash, tmp_path / "reference")
    (src / "checksums.json").unlink()
    assert json.loads((src / "shards.json").read_bytes())[-1] == {"name": "acts000004.bin", "n_examples": 0}
    assert (src / "acts000004.bin").read_bytes() == bytes(md.examples_per_shard * md.example_nbytes)
    with pytest.warns(ss.ProtocolWarning):
        report = store.copy_cache(src, tmp_path / "local")
    assert report.unverified == [f"acts{i:06d}.bin" for i in range(5)]
    assert tree_bytes(report.path) == tree_bytes(src)
