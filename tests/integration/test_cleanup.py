"""Deleting and completing caches from the command line: `rm`, `clean`, `stats` (issue 13
items 4 and 8), run in subprocesses over real caches; the removals as a non-root user too,
since published caches are read-only and only root ignores that."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import cli, fileio, store

from ..support.caches import small_metadata, tree_bytes, write_cache
from ..support.faults import NOBODY, nobody_folder, run_child


def run(env: dict[str, str], *args: str, stdin: str = "") -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards", *args],
        check=False, capture_output=True, text=True, env=env, timeout=120, input=stdin,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def cli_in_this_child(env: dict[str, str], *args: str) -> tuple[int, str]:
    """The command line in a forked child (the venv's interpreter may live where uid 65534
    cannot enter, so `run_child` forks this interpreter and drops privileges instead)."""
    import contextlib
    import io

    os.environ.clear()
    os.environ.update(env)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(list(args))
    return code, out.getvalue()


def environment(base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}
    env.update(SAEV_SCRATCH=str(base / "scratch"), SAEV_NFS=str(base / "nfs"), SAEV_STAGE_ROOT=str(base / "local"))
    return env


def test_rm_lists_asks_and_refuses_caches_runs_link_to(tmp_path: Path):
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    a, b = small_metadata(), small_metadata(n_examples=7)
    write_cache(root, a)
    write_cache(root, b)
    # One reference that names nothing: nothing is removed, whatever came before it.
    code, _, err = run(env, "rm", a.hash[:8], "ffff", "--yes")
    assert code == 3 and "no cache matches hash prefix 'ffff'" in err and (root / a.hash).is_dir()
    code, out, _ = run(env, "rm", a.hash[:8], "--dry-run")
    assert code == 0 and out.startswith("would remove 1 cache, ") and str(root / a.hash) in out
    assert (root / a.hash).is_dir()
    # Not confirmed (stdin closed, or another answer): nothing removed, exit 1.
    for answer in ("", "n\n"):
        code, _, err = run(env, "rm", a.hash[:8], stdin=answer)
        assert code == 1 and "nothing removed: not confirmed (pass --yes" in err and (root / a.hash).is_dir()
    # A run links to b: refused, naming the link, until --force.
    assert run(env, "run", "init", "--train", b.hash[:8], "--id", "r1")[0] == 0
    code, _, err = run(env, "rm", b.hash[:8], "--yes")
    link = tmp_path / "nfs" / "saev" / "runs" / "r1" / "links" / "train-shards"
    assert code == 1 and "refusing to remove 1 cache that runs link to" in err and f"{link}" in err
    assert (root / b.hash).is_dir()
    code, out, _ = run(env, "rm", a.hash[:8], "--runs-root", str(tmp_path / "none"), stdin="y\n")
    assert code == 0 and f"removed {root / a.hash}\n" in out and not (root / a.hash).exists()
    code, out, _ = run(env, "rm", b.hash, "--yes", "--force")
    assert code == 0 and not (root / b.hash).exists() and link.is_symlink() and not link.exists()
    # No runs root configured: the runs cannot be checked, so only --force removes.
    write_cache(root, a)
    no_runs = {k: v for k, v in env.items() if k != "SAEV_NFS"}
    code, _, err = run(no_runs, "rm", a.hash[:8], "--yes")
    assert code == 1 and "cannot check which runs link to 1 cache: no runs root" in err and (root / a.hash).is_dir()


def test_clean_removes_only_what_no_live_writer_holds(tmp_path: Path):
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    local = tmp_path / "local"
    for folder in (root / ".staging-aaaa", root / ".staging-bbbb", local / ".copying-cccc", local / ".copying-dddd"):
        folder.mkdir(parents=True)
        (folder / "part").write_bytes(b"x" * 1000)
    (root / ".staging-eeee.lock").touch()  # a lock file whose staging folder is gone
    live_writer = fileio.take_lock(root / ".staging-bbbb.lock")  # as a writer holds it
    live_copy = fileio.take_lock(local / ".copying-dddd", directory=True)  # as a copy holds it
    assert live_writer is not None and live_copy is not None
    try:
        code, out, _ = run(env, "ls")
        lines = out.splitlines()
        assert any(".staging-aaaa  staging, 1.0 KB, " in line and "stale" in line for line in lines), out
        assert any(".staging-bbbb  staging, 1.0 KB, " in line and "a writer holds it" in line for line in lines)
        code, out, _ = run(env, "clean", "--dry-run")
        assert code == 0 and "would remove 3 stale folders, 2.0 KB" in out
        assert f"keeping {root / '.staging-bbbb'}: a live process holds its lock" in out
        assert f"keeping {local / '.copying-dddd'}" in out and (root / ".staging-aaaa").is_dir()
        assert run(env, "clean")[0] == 1 and (root / ".staging-aaaa").is_dir()  # not confirmed
        code, out, _ = run(env, "clean", "--yes")
        assert code == 0, out
        assert sorted(p.name for p in root.iterdir()) == [".staging-bbbb", ".staging-bbbb.lock"]
        assert sorted(p.name for p in local.iterdir()) == [".copying-dddd"]
    finally:
        os.close(live_writer)
        os.close(live_copy)
    code, out, _ = run(env, "clean", str(root), "--yes")  # the writer is gone now
    assert code == 0 and list(root.iterdir()) == [] and (local / ".copying-dddd").is_dir()
    code, out, _ = run(env, "clean", "--yes")  # the shards and stage roots: the copy's holder is gone too
    assert code == 0 and f"removed {local / '.copying-dddd'}\n" in out and list(local.iterdir()) == []
    assert run(env, "clean", "--yes")[1] == "nothing to clean: no stale staging, copy or shuffle folders\n"


def test_rm_and_clean_as_a_user_whom_modes_bind():
    """Published caches are read-only folders of read-only files: `rm -rf` by their owner
    fails; `saev-shards rm` and `clean` make them writable first."""
    with nobody_folder() as base:
        env = environment(base)
        root = base / "scratch" / "saev" / "shards"
        md = small_metadata()
        write_cache(root, md)
        stale = root / f".staging-{small_metadata(n_examples=9).hash}"
        stale.mkdir()
        (stale / "part").write_bytes(b"x")
        os.chmod(stale / "part", 0o444)
        os.chmod(stale, 0o555)  # as a writer killed while publishing leaves it
        for path in [base, *base.rglob("*")]:
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        if os.geteuid() == 0:
            plain = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                    "rm", "-rf", str(root / md.hash)], capture_output=True, check=False)  # fmt: skip
            assert plain.returncode != 0 and (root / md.hash / "metadata.json").exists()  # modes bind
        removed = run_child(cli_in_this_child, env, "rm", md.hash[:8], "--yes", as_nobody=True)
        assert removed.kind == "ok" and removed.detail.startswith("(0, "), removed
        assert not (root / md.hash).exists()
        theirs = base / "local" / ".copying-ffff"  # another user's copy in a shared stage root (root's)
        theirs.mkdir(parents=True)
        os.chmod(theirs, 0o700)
        as_root = os.geteuid() == 0
        cleaned = run_child(cli_in_this_child, env, "clean", "--yes", as_nobody=True)
        assert cleaned.kind == "ok" and cleaned.detail.startswith("(0, "), cleaned
        assert list(root.iterdir()) == []
        if as_root:  # the children ran as uid 65534: root's folder is not theirs to judge
            assert theirs.is_dir() and f"keeping {theirs}" in cleaned.detail


def test_stats_writes_a_verified_sidecar_that_shards_stats_finds(tmp_path: Path):
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata()
    lengths = (1 + np.arange(md.n_examples) % md.tokens_per_ex).astype(np.int32)
    write_cache(root, md, lengths=lengths)
    with_stats = tmp_path / "with-stats"
    write_cache(with_stats, md, lengths=lengths, stats=True, batches=(3, 5))
    before = tree_bytes(root / md.hash)
    assert ss.open(root / md.hash).stats is None
    code, out, err = run(env, "stats", md.hash[:6] + " ")
    sidecar = root / ".stats" / f"{md.hash}.json"
    assert code == 0 and out == f"{sidecar}\n", err
    tokens = 2 * int(lengths.sum())  # two layers, padding excluded
    assert err == f"{md.hash[:12]}: statistics of {tokens} tokens over 2 layers written beside the cache\n"
    assert tree_bytes(root / md.hash) == before  # the published cache is untouched
    # The same numbers the writer gathers with stats=True (padding excluded by lengths).
    found, written = ss.open(root / md.hash).stats, ss.open(with_stats / md.hash).stats
    assert found is not None and written is not None and found.keys() == written.keys()
    for key in written:
        np.testing.assert_allclose(found[key], written[key], rtol=1e-12)
    code, out, _ = run(env, "info", md.hash[:6])
    assert code == 0 and f"stats      per layer, over stored tokens (computed later: {sidecar}):" in out
    # A local copy takes the sidecar along.
    copy = store.stage(md.hash[:6], tmp_path / "local", roots=[root])
    assert copy.path == tmp_path / "local" / md.hash and (tmp_path / "local" / ".stats" / sidecar.name).is_file()
    assert copy.stats is not None and np.array_equal(copy.stats["count"], found["count"])
    code, _, err = run(env, "stats", md.hash[:6])
    assert code == 0 and "already computed and verified, nothing to do" in err
    code, _, err = run(env, "stats", md.hash[:6], "--force", "--progress")
    assert code == 0 and f"stats {md.hash[:12]}" in err and "100.0%" in err
    code, _, err = run(env, "stats", str(with_stats / md.hash))
    assert code == 0 and "has statistics of its own (stats.json)" in err
    # Verified: damaged numbers, or a sidecar of other data, are errors naming the file.
    obj = json.loads(sidecar.read_text())
    obj["stats"]["norm_mean"][0] += 1.0
    sidecar.write_text(json.dumps(obj))
    with pytest.raises(ss.StatsFileError, match=r"stats_xxh3_128: expected .* damaged; remove it, or make it again"):
        _ = ss.open(root / md.hash).stats
    code, _, err = run(env, "info", md.hash[:6])
    assert code == 1 and str(sidecar) in err
    assert run(env, "stats", md.hash[:6], "--force")[0] == 0 and ss.open(root / md.hash).stats is not None
    other = small_metadata(n_examples=7)
    write_cache(root, other)
    os.replace(sidecar, root / ".stats" / f"{other.hash}.json")
    with pytest.raises(ss.StatsFileError, match=f"cache: expected {other.hash}, found '{md.hash}'"):
        _ = ss.open(root / other.hash).stats
    assert ss.open(root / md.hash).stats is None  # its sidecar is gone
    assert [e.hash for e in store.list_caches(root)] == sorted([md.hash, other.hash])  # .stats is no cache


def test_writing_a_published_cache_again_says_how_to_read_or_remove_it(tmp_path: Path):
    md = small_metadata()
    write_cache(tmp_path, md)
    with pytest.raises(ss.AlreadyPublishedError) as caught:
        ss.ShardWriter(tmp_path, md)
    assert (
        f"read it with ss.open(path) (or by a prefix of its hash in the shards root, ss.open('{md.hash[:8]}')), "
        f"or remove it with `saev-shards rm {md.hash[:12]}` to write it again" in str(caught.value)
    )


def test_clean_removes_the_scratch_folder_of_a_shuffle_that_died_and_keeps_a_live_one(tmp_path: Path):
    from saev_shards.shuffle import plan_shuffle, run_plan

    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata(n_examples=40, d_model=16)
    write_cache(root, md)

    def die_after_first_run(kind: str, index: int) -> None:
        if kind == "run":
            raise KeyboardInterrupt  # as Ctrl-C would: the scratch folder stays for a resume

    plan = plan_shuffle(root / md.hash, seed=1, n_buckets=4, examples_per_chunk=7, memory_bytes=64 << 10)
    with pytest.raises(KeyboardInterrupt):
        run_plan(plan, durable=False, after_step=die_after_first_run)
    assert plan.work.parent == root and plan.work.is_dir()
    code, out, _ = run(env, "ls")
    assert code == 0 and f"{plan.work.name}  shuffle scratch, " in out, out
    assert "interrupted, resumable (" in out and "run the same shuffle again to resume" in out, out
    # While a shuffle holds its lock, the folder is live and kept.
    held = os.open(plan.work / ".lock", os.O_RDWR)
    try:
        assert fileio.try_flock(held)
        code, out, _ = run(env, "clean", "--yes")
        assert code == 0 and f"keeping {plan.work}: a live process holds its lock" in out and plan.work.is_dir()
    finally:
        os.close(held)
    code, out, _ = run(env, "clean", "--dry-run")
    assert code == 0 and "would remove 1 stale folder" in out and "shuffle scratch" in out, out
    assert "1 of them interrupted with work a rerun would resume" in out and "resumable: " in out, out
    code, out, _ = run(env, "clean", "--yes")
    assert code == 0 and f"removed {plan.work}\n" in out and not plan.work.exists()
    assert sorted(p.name for p in root.iterdir()) == [md.hash]


def test_a_stale_ranks_meeting_folder_is_named_as_such_and_has_nothing_to_resume(tmp_path: Path):
    """The folder where a multi-process shuffle's ranks meet (rank records, no buckets or runs):
    `ls` names it for what it is, a rerun resumes nothing from it, `clean` keeps it while a
    rank holds its lock and removes it once none does."""
    from saev_shards.shuffle.meeting import RENDEZVOUS_PREFIX

    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata(n_examples=8, d_model=4)
    write_cache(root, md)
    meeting = root / f"{RENDEZVOUS_PREFIX}{md.hash}"
    meeting.mkdir()
    (meeting / "rank-1.json").write_text('{"rank": 1, "arguments": {}}')
    (meeting / ".lock").touch()
    code, out, _ = run(env, "ls")
    assert code == 0 and f"{meeting.name}  shuffle ranks' meeting folder, " in out, out
    assert "stale, nothing to resume" in out and "shuffle scratch" not in out, out
    held = os.open(meeting / ".lock", os.O_RDWR)
    try:
        assert fileio.try_flock(held)
        code, out, _ = run(env, "ls")
        assert "a shuffle's ranks are meeting in it" in out, out
        code, out, _ = run(env, "clean", "--yes")
        assert code == 0 and f"keeping {meeting}: a live process holds its lock" in out and meeting.is_dir()
    finally:
        os.close(held)
    code, out, _ = run(env, "clean", "--yes")
    assert code == 0 and f"removed {meeting}\n" in out and not meeting.exists(), out
    assert sorted(p.name for p in root.iterdir()) == [md.hash]


# --------------------------------------------------------------------------------------
# caches in use: rm against live readers in other processes

_READER = """
import sys, time
import numpy as np
import saev_shards as ss
how, path = sys.argv[1], sys.argv[2]
if how == "open":  # a notebook: the cache opened, one example read
    shards = ss.open(path)
    shards[0]
elif how == "loader":  # a training loop between two batches
    from saev_shards.loaders import ShuffledLoader
    loader = ShuffledLoader(path, batch_size=8, layers=6, seed=0)
    batch = next(iter(loader))
elif how == "memmap":  # a reader of another library: the shard mapped, no lock
    mapped = np.memmap(path + "/acts000000.bin", dtype=np.uint8, mode="r")
    int(mapped[0])
print("ready", flush=True)
time.sleep(120)
"""


def _reader(how: str, path: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _READER, how, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)[1]
    return proc


@pytest.mark.parametrize(
    ("how", "says"),
    [("open", "holds the cache's lock"), ("loader", "holds the cache's lock"), ("memmap", " acts000000.bin")],
)
def test_rm_refuses_a_cache_a_live_reader_uses_naming_it(tmp_path: Path, how: str, says: str) -> None:
    """Before the fix `rm --yes` deleted the cache under the reader (a loader's next shard
    then failed with a bare FileNotFoundError)."""
    if how == "loader":
        pytest.importorskip("torch")
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata()
    write_cache(root, md)
    reader = _reader(how, root / md.hash)
    try:
        code, out, err = run(env, "rm", md.hash[:8], "--yes")
        assert code == 4, err
        assert f"refusing to remove {root / md.hash}: in use by 1 process: pid {reader.pid} (" in err
        assert says in err and "--force" in err and out == ""
        ss.open(root / md.hash).verify()
        code, out, err = run(env, "rm", md.hash[:8], "--yes", "--force")
        assert code == 0 and f"removed {root / md.hash}" in out and not (root / md.hash).exists()
    finally:
        reader.kill()
        reader.communicate()
    write_cache(root, md)  # the reader gone: removed without --force
    assert run(env, "rm", md.hash[:8], "--yes")[0] == 0 and not (root / md.hash).exists()


def test_the_store_never_removes_a_staging_folder_whose_writer_holds_its_lock(tmp_path: Path) -> None:
    """Before the fix `store.remove` deleted a live writer's staging folder."""
    md = small_metadata()
    writer = ss.ShardWriter(tmp_path, md, durable=False)
    writer.write(np.zeros((3, *md.shape[1:]), np.float32))
    staging = tmp_path / f".staging-{md.hash}"
    for force in (False, True):
        with pytest.raises(ss.CacheInUseError, match=r"a live staging holds its lock .*nothing removed"):
            store.remove(staging, force=force)
    assert staging.is_dir()
    writer.write(np.zeros((md.n_examples - 3, *md.shape[1:]), np.float32))
    writer.close()
    ss.open(tmp_path / md.hash).verify()


# --------------------------------------------------------------------------------------
# statistics sidecars: written only inside the root, range-checked when read


def test_stats_never_writes_through_a_stats_folder_that_is_a_link(tmp_path: Path) -> None:
    """Before the fix the sidecar landed in the folder the link pointed to, outside the root."""
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata()
    write_cache(root, md)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / ".stats").symlink_to(outside)
    code, out, err = run(env, "stats", md.hash[:8])
    assert code == 1 and out == "", err
    assert f"{root / '.stats'}: expected the folder of statistics sidecars, found a symbolic link" in err
    assert list(outside.iterdir()) == []
    (root / ".stats").unlink()
    assert run(env, "stats", md.hash[:8])[0] == 0 and (root / ".stats" / f"{md.hash}.json").is_file()


def _rewrite_sidecar(path: Path, change: Any) -> None:
    """Edit a sidecar's statistics and recompute its digest, as a careful vandal would."""
    import xxhash

    from saev_shards.protocol.v3 import pretty_json

    obj = json.loads(path.read_text())
    change(obj["stats"])
    obj["stats_xxh3_128"] = xxhash.xxh3_128_hexdigest(pretty_json(obj["stats"]))
    path.write_text(json.dumps(obj))


#: (change to a sidecar's statistics, what the error says); the cache has 23 x 5 = 115 token positions.
SIDECAR_EDITS = {
    "negative variance": (
        lambda s: s["var"][0].__setitem__(3, -0.5),
        r"var\[0, 3\]: expected a number >= 0 \(a variance or a norm\), found -0.5",
    ),
    "negative norm": (lambda s: s["norm_mean"].__setitem__(1, -1.0), r"norm_mean\[1\]: expected a number >= 0"),
    "negative squared norm": (
        lambda s: s["norm_sq_mean"].__setitem__(0, -2.0),
        r"norm_sq_mean\[0\]: expected a number >= 0",
    ),
    "count past the cache": (
        lambda s: s["count"].__setitem__(0, 10**9),
        r"count\[0\] \+ nonfinite\[0\]: expected at most 115 .*found 1,000,000,000 \+ 0",
    ),
    "nonfinite past the cache": (
        lambda s: s["nonfinite"].__setitem__(1, 116),
        r"count\[1\] \+ nonfinite\[1\]: expected at most 115",
    ),
    "count 0 with values": (
        lambda s: s.update(count=[0, s["count"][1]]),
        r"mean\[0\]: expected zeros \(its count is 0",
    ),
    "a string among the variances": (lambda s: s["var"].__setitem__(0, "x"), r"var: expected 2 arrays of 8 numbers"),
}


@pytest.mark.parametrize("edit", list(SIDECAR_EDITS))
def test_a_sidecar_with_a_recomputed_digest_is_still_range_checked(tmp_path: Path, edit: str) -> None:
    """Before the fix a negative variance with a recomputed digest was accepted (then a
    square root of a negative number downstream), and counts were never compared with the cache."""
    change, message = SIDECAR_EDITS[edit]
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata()  # 23 examples x 5 tokens: 115 token positions
    write_cache(root, md)
    assert run(env, "stats", md.hash[:8])[0] == 0
    sidecar = root / ".stats" / f"{md.hash}.json"
    _rewrite_sidecar(sidecar, change)
    with pytest.raises(ss.StatsFileError, match=message):
        _ = ss.open(root / md.hash).stats
    code, _, err = run(env, "info", md.hash[:8])
    assert code == 1 and str(sidecar) in err


def test_stats_json_inside_a_cache_is_range_checked_too(tmp_path: Path) -> None:
    md = small_metadata()
    write_cache(tmp_path, md, stats=True)
    shards = ss.open(tmp_path / md.hash)
    assert shards.stats is not None and (shards.stats["var"] >= 0).all()
    from saev_shards.protocol.v3 import parse_stats

    raw = json.loads((tmp_path / md.hash / "stats.json").read_text())
    raw["var"][1][0] = -1e-3
    with pytest.raises(ss.StatsFileError, match=r"var\[1, 0\]: expected a number >= 0"):
        parse_stats(raw, md.layers, md.d_model, "stats.json", md.n_examples * md.tokens_per_ex)


def test_ls_and_clean_tell_an_interrupted_resumable_write_from_an_abandoned_one(tmp_path: Path):
    """A dump interrupted after sealing shards resumes when run again: `ls` says so (its part
    records, its lock free) instead of calling it stale, and `clean` says what it would discard."""
    env = environment(tmp_path)
    root = tmp_path / "scratch" / "saev" / "shards"
    md = small_metadata(n_examples=20, patches_per_shard=5 * 5 * 2)  # 5 examples per shard: 4 shards
    assert md.n_shards == 4
    acts = np.zeros((10, *md.shape[1:]), np.float16)
    with pytest.raises(KeyboardInterrupt), ss.ShardWriter(root, md, durable=False) as w:
        w.write(acts)  # shards 0 and 1 sealed
        raise KeyboardInterrupt  # as Ctrl-C: the writer aborts and keeps what is sealed
    abandoned = root / f".staging-{small_metadata(n_examples=9).hash}"
    abandoned.mkdir()
    (abandoned / "part000000.acts.bin").write_bytes(b"x" * 100)  # a part file, never sealed
    code, out, _ = run(env, "ls")
    lines = {line.split(":", 1)[1].split()[0]: line for line in out.splitlines() if "unpublished" in line}
    resumable = lines[f".staging-{md.hash}"]
    assert "interrupted, resumable (2 of 4 shards sealed): run its writer again to resume" in resumable, out
    assert "`saev-shards clean` would discard it" in resumable and "stale" not in resumable
    assert "stale, nothing to resume: `saev-shards clean` removes it" in lines[abandoned.name], out
    code, out, _ = run(env, "ls", "--json")
    listed = {Path(u["path"]).name: u for u in json.loads(out)[0]["unpublished"]}
    assert (listed[f".staging-{md.hash}"]["resumable"], listed[f".staging-{md.hash}"]["sealed"]) == (True, 2)
    assert listed[abandoned.name]["resumable"] is False
    code, out, _ = run(env, "clean", "--dry-run")
    assert "would remove 2 stale folders" in out and "(1 of them interrupted with work a rerun would resume" in out
    assert "resumable: 2 of 4 shards sealed" in out and "nothing to resume" in out, out
    code, _, err = run(env, "clean", stdin="n\n")
    assert code == 1 and "1 of them holds resumable work, which would start over [y/N]" in err, err
    # The rerun resumes from the sealed shards; then nothing is left to clean but the abandoned folder.
    with ss.ShardWriter(root, md, durable=False, resume=True) as w:
        assert w.next_example == 10
        w.write(np.zeros((10, *md.shape[1:]), np.float16))
    code, out, _ = run(env, "clean", "--yes")
    assert code == 0 and f"removed {abandoned}" in out and "resumable" not in out, out
