"""The saev-shards command line, driven in subprocesses over real caches: output and exit codes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import saev_shards as ss
from saev_shards import cli
from saev_shards.humanize import human_bytes

from ..support.caches import colliding_metadata, small_metadata, tree_bytes, writable_copy, write_cache
from ..support.cli import cli_with_ctrl_c


@dataclass
class Result:
    code: int
    out: str
    err: str


@dataclass
class Store:
    """A scratch and an NFS folder as seed 004 lays them out, with two caches."""

    base: Path
    env: dict[str, str]
    shards_root: Path
    full: ss.Metadata  # labels, a lengths column, text and statistics
    plain: ss.Metadata  # activations only, bfloat16

    def run(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Result:
        proc = subprocess.run(
            [sys.executable, "-m", "saev_shards", *args],
            check=False,
            capture_output=True,
            text=True,
            env=env if env is not None else self.env,
            cwd=cwd or self.base,
            timeout=120,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=60
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory) -> Store:
    base = tmp_path_factory.mktemp("cli")
    scratch, nfs = base / "scratch", base / "nfs"
    shards_root = scratch / "saev" / "shards"
    full = small_metadata()
    lengths = (1 + __import__("numpy").arange(full.n_examples) % full.tokens_per_ex).astype("int32")
    write_cache(shards_root, full, labels=True, text=True, lengths=lengths, stats=True)
    plain = small_metadata(n_examples=7, dtype="bfloat16")
    write_cache(shards_root, plain)
    env = clean_env(SAEV_SCRATCH=str(scratch), SAEV_NFS=str(nfs), SAEV_STAGE_ROOT=str(base / "local"))
    return Store(base, env, shards_root, full, plain)


def one_error_line(r: Result) -> str:
    """The error output must be exactly one line, and never a traceback."""
    assert "Traceback" not in r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("saev-shards: error: ")
    return lines[0]


# --------------------------------------------------------------------------------------
# help


def test_help_lists_commands_roots_and_exit_codes(st: Store):
    r = st.run("--help")
    assert r.code == 0
    for command in ("info", "ls", "verify", "resolve", "stage", "stats", "rm", "clean", "shuffle", "convert", "run",
                    "doctor", "dump"):  # fmt: skip
        assert f"\n    {command}" in r.out
    assert "$SAEV_SHARDS_ROOT" in r.out and "$SAEV_SCRATCH/saev/shards" in r.out and "$SAEV_NFS/saev/runs" in r.out
    assert cli.EXIT_CODES_HELP in r.out


COMMANDS = [
    "info", "ls", "verify", "resolve", "stage", "stats", "rm", "clean", "shuffle", "convert", "run", "run init",
    "run show", "doctor",
]  # fmt: skip


def test_every_command_has_help_with_examples(st: Store):
    # One interpreter runs every `<command> --help` (each exits 0 via SystemExit): ~0.3 s, not 3.
    code = (
        "import contextlib, io, json, sys\nfrom saev_shards.cli import main\nout = {}\n"
        f"for command in {COMMANDS!r}:\n"
        "    buf = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(buf):\n"
        "            main([*command.split(), '--help'])\n"
        "    except SystemExit as e:\n"
        "        out[command] = (e.code, buf.getvalue())\n"
        "print(json.dumps(out))\n"
    )
    proc = python(code, st.env)
    assert proc.returncode == 0, proc.stderr
    helps = json.loads(proc.stdout)
    assert sorted(helps) == sorted(COMMANDS)
    for command, (exit_code, text) in helps.items():
        assert exit_code == 0, command
        examples = text.split("examples:\n", 1)[1]
        assert f"  saev-shards {command} " in examples, command
        assert "exit codes:" in text, command


def test_usage_errors_exit_2(st: Store):
    r = st.run("info")
    assert r.code == 2 and "the following arguments are required: ref" in r.err
    r = st.run("frobnicate")
    assert r.code == 2 and "invalid choice: 'frobnicate'" in r.err


# --------------------------------------------------------------------------------------
# info, ls, verify, resolve


def test_info_text(st: Store):
    r = st.run("info", st.full.hash[:6])
    assert r.code == 0, r.err
    fields = dict(line.split(None, 1) for line in r.out.splitlines() if line and not line.startswith(" "))
    assert fields["cache"] == st.full.hash
    assert fields["path"] == str(st.shards_root / st.full.hash)
    assert fields["shape"] == "(23, 2, 5, 8)  examples x layers x tokens x d_model"
    assert fields["dtype"] == "float16 (2 bytes per value)"
    assert fields["layers"] == "[6, 11]"
    assert fields["tokens"] == "5 per example (CLS + 4)"
    assert fields["shards"] == "5 x 5 examples (last: 3)"
    assert fields["bytes"].startswith("3,680 bytes of activations (3.7 KB), ")
    assert fields["labels"] == "uint8 (23, 4)"
    assert fields["columns"] == "lengths int32 (23,)"
    assert fields["text"] == "prompt (23 lines)"
    assert fields["checksums"] == "xxh3_128 for every file and every 16 MiB block of it (blocks.json)"
    stats = [line.split() for line in r.out.splitlines() if line.startswith("  ")]
    assert stats[0] == ["layer", "tokens", "mean", "|x|", "mean", "|x|^2", "mean", "var", "non-finite"]
    counted = int(ss.open(st.shards_root / st.full.hash).stats["count"][0])  # type: ignore[index]
    assert [row[:2] for row in stats[1:]] == [["6", f"{counted:,}"], ["11", f"{counted:,}"]]


def test_info_json(st: Store):
    r = st.run("info", st.plain.hash, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    md = st.plain
    assert info["hash"] == md.hash
    assert info["shape"] == list(md.shape)
    assert info["dtype"] == "bfloat16"
    assert info["layers"] == [6, 11]
    assert info["n_shards"] == md.n_shards == len(info["shards"])
    assert info["nbytes"] == md.nbytes == sum(s["nbytes"] for s in info["shards"])
    assert info["labels"] is None and info["columns"] == {} and info["text"] == {} and info["stats"] is None
    assert info["data"] == md.data and info["dataset"] == md.dataset


def test_ls_lists_caches_sizes_and_unpublished_folders(st: Store, tmp_path: Path):
    r = st.run("ls")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith(f"{st.shards_root} (SAEV_SCRATCH): 2 caches, ")
    assert lines[1].split() == ["HASH", "MODEL", "FORMAT", "DTYPE", "SHAPE", "SHARDS", "SIZE", "STATUS"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows[st.full.hash[:12]][1:7] == ["clip:test/ckpt", ss.PROTOCOL, "float16", "(23,", "2,", "5,"]
    assert rows[st.plain.hash[:12]][-1] == "ok" and rows[st.plain.hash[:12]][3] == "bfloat16"
    # Another root, given on the command line, holding an interrupted copy.
    (tmp_path / ".copying-abcd").mkdir()
    r = st.run("ls", str(tmp_path), "--json")
    assert r.code == 0
    listing = json.loads(r.out)
    assert listing[0]["unpublished"][0].pop("age_s") >= 0
    assert listing == [
        {"root": str(tmp_path), "source": "argument", "exists": True, "caches": [], "unpublished": [
            {"path": str(tmp_path / ".copying-abcd"), "kind": "copy", "nbytes": 0, "live": False,
             "resumable": False, "sealed": 0, "n_shards": None}]}
    ]  # fmt: skip
    r = st.run("ls", str(tmp_path))
    assert re.fullmatch(
        r"  unpublished \(being written, or interrupted\): \.copying-abcd  partial copy, 0 B, \d+ s old, "
        r"stale, nothing to resume: `saev-shards clean` removes it",
        r.out.splitlines()[-1],
    )
    r = st.run("ls", str(tmp_path / "nowhere"))
    assert r.code == 3 and r.out == f"{tmp_path / 'nowhere'} (argument): no such directory\n"


def test_verify_ok_with_a_progress_bar(st: Store):
    r = st.run("verify", st.full.hash[:5], "--progress")
    assert r.code == 0, r.err
    files = len(ss.open(st.shards_root / st.full.hash).manifest.files())
    assert r.out.startswith(f"ok {st.shards_root / st.full.hash}\n   {files} files, ")
    assert "sizes, xxh3_128 checksums and the metadata hash match" in r.out
    assert f"verify {st.full.hash[:12]}: 100.0%" in r.err
    r = st.run("verify", st.full.hash[:5])  # not a terminal: no bar unless asked
    assert r.code == 0 and r.err == ""


def test_resolve_unique_ambiguous_unknown_and_short_prefixes(st: Store, tmp_path: Path):
    r = st.run("resolve", st.full.hash[:4])
    assert r.code == 0 and r.out == f"{st.shards_root / st.full.hash}\n"
    a, b = colliding_metadata()
    write_cache(tmp_path / "a", a)
    write_cache(tmp_path / "b", b)
    roots = ("--root", str(tmp_path / "a"), "--root", str(tmp_path / "b"))
    r = st.run("resolve", a.hash[:4], *roots)
    assert r.code == 3 and r.out == ""
    assert r.err.splitlines() == [
        f"saev-shards: error: hash prefix '{a.hash[:4]}' is ambiguous: 2 caches match; give more digits:",
        *sorted([f"  {a.hash} in {tmp_path / 'a'}", f"  {b.hash} in {tmp_path / 'b'}"]),
    ]
    n = next(i for i in range(64) if a.hash[i] != b.hash[i]) + 1
    r = st.run("resolve", b.hash[:n], *roots)
    assert r.code == 0 and r.out == f"{tmp_path / 'b' / b.hash}\n"
    unknown = next(p for p in ("0000", "1111", "2222") if not any(h.startswith(p) for h in (a.hash, b.hash)))
    r = st.run("resolve", unknown, *roots)
    assert r.code == 3
    line = one_error_line(r)
    assert line.startswith(
        f"saev-shards: error: no cache matches hash prefix '{unknown}' in "
        f"{tmp_path / 'a'} (argument), {tmp_path / 'b'} (argument); caches there, closest first: "
    )
    assert line.endswith(" (`saev-shards ls` lists them)") and a.hash[:12] in line and b.hash[:12] in line
    # A typo in the 6th digit of b's hash: b is suggested first (longest common prefix).
    typo = b.hash[:5] + ("0" if b.hash[5] != "0" else "1") + b.hash[6:8]
    r = st.run("resolve", typo, *roots)
    assert r.code == 3 and f"closest first: {b.hash[:12]}, {a.hash[:12]} " in one_error_line(r)
    r = st.run("resolve", b.hash[:5] + "g", *roots)  # not even hex: still shown what exists
    assert r.code == 3 and "not a hash or hash prefix" in one_error_line(r)
    assert f"; caches in the shards roots, closest first: {b.hash[:12]}, {a.hash[:12]} " in one_error_line(r)
    r = st.run("resolve", f"{b.hash[:n]} ", *roots)  # a space pasted with the hash is dropped
    assert r.code == 0 and r.out == f"{tmp_path / 'b' / b.hash}\n"
    r = st.run("resolve", "abc")
    assert r.code == 3 and "too short: expected at least 4 hex digits, found 3" in one_error_line(r)


def test_errors_are_one_line_and_tracebacks_need_debug(st: Store):
    r = st.run("info", "beefbeef")
    assert r.code == 3
    assert (
        one_error_line(r).split("; caches there")[0]
        == f"saev-shards: error: no cache matches hash prefix 'beefbeef' in {st.shards_root} (SAEV_SCRATCH)"
    )
    r = st.run("--debug", "info", "beefbeef")
    assert r.code == 3
    assert "Traceback (most recent call last)" in r.err and "UnknownCacheError" in r.err
    assert r.err.splitlines()[-1].startswith("saev-shards: error: no cache matches")


def test_no_root_configured(st: Store):
    env = clean_env()
    r = st.run("ls", env=env)
    assert r.code == 2
    assert "no shards root: pass one explicitly (--root), or set SAEV_SHARDS_ROOT" in one_error_line(r)
    r = st.run("info", st.full.hash[:8], env=env)
    assert r.code == 3
    assert "no shards root to look up the hash prefix" in one_error_line(r)
    # A path needs no root.
    r = st.run("resolve", str(st.shards_root / st.full.hash), env=env)
    assert r.code == 0


# --------------------------------------------------------------------------------------
# broken caches

BROKEN = {
    # kind: (how, what info says, what verify says, whether ls and info see it)
    "missing shard": ("acts000002.bin: missing", True),
    "truncated shard": ("acts000001.bin: expected 800 bytes, found 100 (file seems not fully written?)", True),
    "modified shard": ("acts000003.bin: xxh3_128 expected ", False),
    "wrong hash": ("directory name is not the hash of its metadata.json", True),
}


def break_cache(st: Store, kind: str, dest_root: Path) -> Path:
    src = st.shards_root / st.full.hash
    cache = writable_copy(src, dest_root)
    if kind == "missing shard":
        (cache / "acts000002.bin").unlink()
    elif kind == "truncated shard":
        with open(cache / "acts000001.bin", "r+b") as f:
            f.truncate(100)
    elif kind == "modified shard":
        data = bytearray((cache / "acts000003.bin").read_bytes())
        data[100] ^= 0x40
        (cache / "acts000003.bin").write_bytes(bytes(data))
    elif kind == "wrong hash":
        cache = cache.rename(dest_root / ("f" * 64))
    return cache


@pytest.mark.parametrize("kind", list(BROKEN))
def test_broken_caches_info_verify_ls(st: Store, tmp_path: Path, kind: str):
    message, visible_without_checksums = BROKEN[kind]
    cache = break_cache(st, kind, tmp_path)
    info = st.run("info", str(cache))
    verify = st.run("verify", str(cache))
    ls = st.run("ls", str(tmp_path))
    assert verify.code == 1
    assert verify.out == ""
    assert message in verify.err and f"saev-shards: error: {cache}" in verify.err
    assert "Traceback" not in verify.err
    if visible_without_checksums:
        assert info.code == 1 and message in info.err and info.out == ""
        assert ls.code == 1
        assert f"1 cache, {cli.human_bytes(sum(p.stat().st_size for p in cache.iterdir()))}, 1 broken" in ls.out
        assert "BROKEN: " in ls.out and message.split(" (")[0].split(": ")[-1] in ls.out
    else:  # same sizes: only the checksums tell
        assert info.code == 0 and ls.code == 0 and ls.out.rstrip().endswith("ok")


def test_several_problems_are_all_listed(st: Store, tmp_path: Path):
    cache = break_cache(st, "missing shard", tmp_path)
    with open(cache / "acts000004.bin", "r+b") as f:
        f.truncate(1)
    r = st.run("verify", str(cache))
    assert r.code == 1
    assert r.err.splitlines() == [
        f"saev-shards: error: {cache}: 2 problems",
        "  missing (1):",
        f"    - {cache}/acts000002.bin: missing",
        "  size (1):",
        f"    - {cache}/acts000004.bin: expected 480 bytes, found 1 (file seems not fully written?)",
    ]


# --------------------------------------------------------------------------------------
# stage


def test_stage_copies_verifies_and_prints_the_local_path(st: Store, tmp_path: Path):
    local = tmp_path / "local"
    r = st.run("stage", st.plain.hash[:6], "--to", str(local))
    assert r.code == 0, r.err
    assert r.out == f"{local / st.plain.hash}\n"
    listed = ss.open(st.shards_root / st.plain.hash).manifest.files()
    copied = human_bytes(sum(n for _, n, _ in listed))
    assert r.err == f"{st.plain.hash[:12]}: copied {len(listed)} files ({copied}); checksums verified\n"
    assert tree_bytes(local / st.plain.hash) == tree_bytes(st.shards_root / st.plain.hash)
    r = st.run("stage", st.plain.hash[:6], "--to", str(local))
    assert r.code == 0 and r.err == f"{st.plain.hash[:12]}: already staged, nothing copied\n"
    # The default destination: $SAEV_STAGE_ROOT.
    r = st.run("stage", st.plain.hash[:6])
    assert r.code == 0 and r.out == f"{st.base / 'local' / st.plain.hash}\n"


def test_stage_interrupted_then_resumed(st: Store, tmp_path: Path):
    local = tmp_path / "local"
    files = ss.open(st.shards_root / st.full.hash).manifest.files()
    copied = 0

    def interrupt(n: int) -> None:
        nonlocal copied
        copied += n
        if copied >= files[0][1] + files[1][1]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ss.store.copy_cache(st.shards_root / st.full.hash, local, on_bytes=interrupt)
    partial = local / f".copying-{st.full.hash}"
    half = partial / files[1][0]
    half.write_bytes(half.read_bytes()[:300])  # as if the copy stopped mid-file
    r = st.run("ls", str(local))
    assert r.out.splitlines()[-1].startswith(
        f"  unpublished (being written, or interrupted): .copying-{st.full.hash}  partial copy, "
    )
    r = st.run("stage", st.full.hash, "--to", str(local))
    assert r.code == 0, r.err
    assert r.out == f"{local / st.full.hash}\n"
    assert r.err == (
        f"{st.full.hash[:12]}: copied {len(files) - 2} files "
        f"({cli.human_bytes(sum(n for _, n, _ in files[2:]) + files[1][1] - 300)}); "
        f"resumed: kept 1 complete and 1 half-written files ({cli.human_bytes(files[0][1] + 300)}) "
        "after re-verifying them; checksums verified\n"
    )
    assert st.run("verify", str(local / st.full.hash)).code == 0
    assert not partial.exists()


def test_stage_of_a_damaged_source_fails_and_publishes_nothing(st: Store, tmp_path: Path):
    src_root = tmp_path / "src"
    src_root.mkdir()
    cache = break_cache(st, "modified shard", src_root)
    r = st.run("stage", str(cache), "--to", str(tmp_path / "local"))
    assert r.code == 1 and r.out == ""
    line = one_error_line(r)
    assert f"{cache}/acts000003.bin: xxh3_128 expected" in line
    assert f"the source cache is damaged (check it with: saev-shards verify {cache})" in line
    assert not (tmp_path / "local" / st.full.hash).exists()


@pytest.mark.slow
def test_stage_killed_by_ctrl_c_resumes(tmp_path: Path):
    """A real interruption: SIGINT while a ~300 MB copy runs, then the same command again."""
    md = small_metadata(n_examples=1500, d_model=1024, patches_per_ex=49, layers=(1, 2), patches_per_shard=1_000_000)
    import numpy as np

    rng = np.random.default_rng(0)
    with ss.ShardWriter(tmp_path / "shards", md, durable=False) as w:
        for start in range(0, md.n_examples, 100):
            w.write(rng.standard_normal((min(100, md.n_examples - start), *md.shape[1:]), dtype=np.float32))
    env = clean_env(SAEV_SHARDS_ROOT=str(tmp_path / "shards"))
    local = tmp_path / "local"
    partial = local / f".copying-{md.hash}"
    args = cli_with_ctrl_c("stage", md.hash[:8], "--to", str(local))
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (partial.is_dir() and any(p.stat().st_size for p in partial.iterdir())):
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert out == ""
    assert err.endswith("saev-shards: interrupted; what was copied is kept: run the same command again to resume\n")
    assert partial.is_dir() and not (local / md.hash).exists()
    done = subprocess.run(args, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "resumed: kept " in done.stderr
    assert tree_bytes(local / md.hash) == tree_bytes(tmp_path / "shards" / md.hash)


# --------------------------------------------------------------------------------------
# runs


def test_run_init_show_and_doctor(st: Store, tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    elsewhere = tmp_path / "on-another-machine"
    r = st.run(
        "run", "init", "--train", st.full.hash[:6], "--val", st.plain.hash[:6], "--id", "sae-16k",
        "--train-dataset", str(data), "--val-dataset", str(elsewhere), "--runs-root", str(tmp_path / "runs"),
    )  # fmt: skip
    run = tmp_path / "runs" / "sae-16k"
    assert r.code == 0, r.err
    assert r.out.splitlines() == [
        f"created run {run}",
        f"  links/train-shards   -> {st.shards_root / st.full.hash}",
        f"  links/train-dataset  -> {data}",
        f"  links/val-shards     -> {st.shards_root / st.plain.hash}",
        f"  links/val-dataset    -> {elsewhere}  (does not exist here)",
        "  checkpoint/          (empty: training writes sae.pt and config.json here)",
        "  inference/           (empty: outputs of the trained SAE, one folder per cache)",
    ]
    # What training relies on is checked at init too, not only by doctor.
    assert r.err == (
        f"saev-shards: warning: --val {st.plain.hash[:12]}: train and val caches differ: "
        "dtype 'float16' vs 'bfloat16'\n"
    )
    r = st.run("run", "show", "--run", str(run), "--json")
    assert r.code == 0
    assert json.loads(r.out) == {
        "run": str(run),
        "train-shards": str(st.shards_root / st.full.hash),
        "train-dataset": str(data),
        "val-shards": str(st.shards_root / st.plain.hash),
        "val-dataset": None,
        "sae_checkpoint": str(run / "checkpoint" / "sae.pt"),
        "checkpoint_config": str(run / "checkpoint" / "config.json"),
    }
    r = st.run("doctor", "--run", str(run))
    assert r.code == 1
    lines = r.out.splitlines()
    assert lines[0] == f"run {run}"
    assert [line.split()[:2] for line in lines[1:-1]] == [
        ["ok", "links/train-shards"],
        ["ok", "links/train-dataset"],
        ["ok", "links/val-shards"],
        ["ERROR", "links/val-dataset"],
        ["note", "checkpoint/sae.pt"],
        ["note", "checkpoint/config.json"],
        ["WARNING", "links/val-shards"],
    ]
    assert f"dangling: points to {elsewhere}, which does not exist" in lines[4]
    assert "train and val caches differ: dtype 'float16' vs 'bfloat16'" in lines[7]
    assert lines[-1] == "1 error, 1 warning"
    # Repair the link: healthy, but not trained; --trained makes that an error.
    (run / "links" / "val-dataset").unlink()
    (run / "links" / "val-dataset").symlink_to(data)
    r = st.run("doctor", "--run", str(run), "--json")
    assert r.code == 0
    report = json.loads(r.out)
    assert (report["errors"], report["warnings"]) == (0, 1)
    r = st.run("doctor", "--run", str(run), "--trained")
    assert r.code == 1 and r.out.splitlines()[-1] == "2 errors, 1 warning"
    # A bare run id resolves in $SAEV_RUNS_ROOT; an unknown one is "not found".
    env = dict(st.env, SAEV_RUNS_ROOT=str(tmp_path / "runs"))
    assert st.run("doctor", "--run", "sae-16k", env=env).code == 0
    r = st.run("doctor", "--run", "nope", env=env)
    assert r.code == 3
    assert one_error_line(r) == (
        f"saev-shards: error: no run folder at {st.base / 'nope'} nor {tmp_path / 'runs' / 'nope'}"
    )
    r = st.run("run", "init", "--train", st.full.hash[:6], "--id", "sae-16k", env=env)
    assert r.code == 2 and one_error_line(r) == f"saev-shards: error: {run}: a run with this id already exists"


def test_doctor_verify_catches_a_modified_linked_cache(st: Store, tmp_path: Path):
    broken_root = tmp_path / "broken"
    broken_root.mkdir()
    cache = break_cache(st, "modified shard", broken_root)
    data = tmp_path / "data"
    data.mkdir()
    r = st.run("run", "init", "--train", str(cache), "--train-dataset", str(data), "--id", "r",
               "--runs-root", str(tmp_path / "runs"))  # fmt: skip
    assert r.code == 0, r.err
    run = str(tmp_path / "runs" / "r")
    assert st.run("doctor", "--run", run).code == 0  # sizes are right
    r = st.run("doctor", "--run", run, "--verify")
    assert r.code == 1
    error = next(line for line in r.out.splitlines() if line.split()[:2] == ["ERROR", "links/train-shards"])
    assert "verification failed" in error and "acts000003.bin: xxh3_128 expected" in error
    # Dangling shards link.
    shutil.rmtree(broken_root)
    r = st.run("doctor", "--run", run)
    assert r.code == 1
    error = next(line for line in r.out.splitlines() if line.split()[:2] == ["ERROR", "links/train-shards"])
    assert error.endswith(f"dangling: points to {cache}, which does not exist")


def test_doctor_without_a_run_checks_the_roots(st: Store):
    r = st.run("doctor")
    assert r.code == 0, r.err
    assert r.out.splitlines()[1].split() == ["ok", "shards", "root", str(st.shards_root), "(SAEV_SCRATCH)"]
    assert "runs root    " in r.out and "stage root   " in r.out
    r = st.run("doctor", env=clean_env())
    assert r.code == 1 and "ERROR    shards root" in r.out and "ERROR    runs root" in r.out


# --------------------------------------------------------------------------------------
# dump, entry points


def test_cli_never_imports_torch_or_dump_unless_dump_runs(st: Store):
    code = (
        "import sys\nfrom saev_shards import cli\n"
        f"assert cli.main(['ls', {str(st.shards_root)!r}]) == 0\n"
        f"assert cli.main(['info', {st.full.hash[:6]!r}, '--root', {str(st.shards_root)!r}]) == 0\n"
        "assert 'torch' not in sys.modules and 'saev_shards.dump' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = python(code, st.env)
    assert proc.returncode == 0, proc.stderr


def test_dump_missing_is_one_line_error(st: Store):
    code = (
        "import sys\nsys.modules['saev_shards.dump'] = None\nfrom saev_shards.cli import main\n"
        "sys.exit(main(['dump', 'dump.toml']))"
    )
    proc = python(code, st.env)
    assert proc.returncode == 2
    assert proc.stderr == (
        "saev-shards: error: the dump command is not available in this installation (no module saev_shards.dump)\n"
    )


def test_dump_help_comes_from_the_dump_module(st: Store):
    r = st.run("dump", "--help")
    assert r.code == 0, r.err
    assert r.out.startswith("usage: saev-shards dump")
    assert "exit codes:" in r.out


def test_console_script_and_version(st: Store):
    script = Path(sys.executable).parent / "saev-shards"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    proc = subprocess.run([str(script), "--version"], check=False, capture_output=True, text=True, env=st.env)
    assert proc.returncode == 0 and proc.stdout == f"saev-shards {ss.__version__}\n"


def test_a_reader_that_goes_away_is_not_an_error(st: Store):
    args = [sys.executable, "-m", "saev_shards", "info", st.full.hash, "--json"]
    proc = subprocess.Popen(args, env=st.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head` exiting before we write
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == cli.EXIT_BROKEN_PIPE
    assert err == b""


@pytest.mark.slow
def test_docs_walkthrough_is_the_real_output():
    """docs/store.md shows what docs/walkthrough.sh prints; rerun the script when this fails.

    It runs in /tmp/demo, as documented: the caches' hashes depend on their dataset paths.
    """
    import fcntl

    repo = Path(__file__).resolve().parents[2]
    with open("/tmp/demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one walk-through at a time in /tmp/demo
        proc = subprocess.run(
            ["bash", str(repo / "docs" / "walkthrough.sh"), "/tmp/demo"],
            check=False, capture_output=True, text=True, env=clean_env(), timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    walkthrough = (repo / "docs" / "store.md").read_text().split("## A terminal walk-through\n", 1)[1]
    documented = walkthrough.split("```console\n", 1)[1].rsplit("```", 1)[0]
    assert proc.stdout.rstrip("\n") + "\n" == documented
    # docs/cli.md shows an excerpt: every command it shows, with its output, is in the real run.
    section = (repo / "docs" / "cli.md").read_text().split("## An example session\n", 1)[1]
    excerpt = section.split("```console\n", 1)[1].split("```", 1)[0]
    for step in excerpt.strip("\n").split("\n\n"):
        assert step + "\n" in proc.stdout, step


def test_info_of_a_saev_cache_shows_its_dialect_pixel_agg_and_no_cls():
    saev_cache = Path(__file__).resolve().parents[1] / "data" / "saev-code-exact" / "saev" / "shards" / "3a3c1749"
    command = [sys.executable, "-m", "saev_shards", "info", str(saev_cache)]
    r = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # One short line, once (it was ~300 characters, sometimes twice per command).
    assert r.stderr == (
        "saev-shards: warning: 3a3c1749: protocol 2.1 cache (saev dialect), read by protocol.md section 9 "
        "(no checksums unless checksums.json)\n"
    )
    fields = dict(line.split(None, 1) for line in r.stdout.splitlines() if line and not line.startswith(" "))
    assert fields["protocol"] == "2.1, dialect saev (protocol 2.1 as saev's code writes it)"
    assert fields["pixel_agg"] == "majority"
    assert fields["tokens"] == "4 per example (4 patches, no CLS token)"
    r = subprocess.run([*command, "--json"], check=True, capture_output=True, text=True, timeout=120)
    info = json.loads(r.stdout)
    assert (info["protocol"], info["dialect"], info["pixel_agg"]) == ("2.1", "saev", "majority")
    assert info["cls_token"] is False


def test_info_of_a_protocol_3_cache_has_no_dialect_or_pixel_agg_row(st: Store):
    r = st.run("info", st.plain.hash)
    assert r.code == 0, r.err
    fields = dict(line.split(None, 1) for line in r.out.splitlines() if line and not line.startswith(" "))
    assert fields["protocol"] == ss.PROTOCOL and "pixel_agg" not in fields
    info = json.loads(st.run("info", st.plain.hash, "--json").out)
    assert (info["dialect"], info["pixel_agg"]) == (ss.PROTOCOL, None)


def test_info_stats_and_verify_of_a_float8_cache(tmp_path: Path):
    """A float8_e4m3 cache: `info` says how it is stored and read, `stats` computes the
    statistics of its dequantized values (what the writer would have written), and `verify`
    names the damaged block of a scale file."""
    import numpy as np

    root = tmp_path / "shards"
    md = small_metadata(dtype="float8_e4m3")
    write_cache(root, md)
    env = clean_env(SAEV_SHARDS_ROOT=str(root))
    store_ = Store(tmp_path, env, root, md, md)
    info = store_.run("info", md.hash[:8])
    assert info.code == 0, info.err
    assert "float8_e4m3 (1 byte per value, a float32 scale per vector; read as float16)" in info.out
    assert "1,840 bytes of activations (1.8 KB), 920 B of scales" in info.out
    assert "every 16 MiB block of it (blocks.json)" in info.out
    as_json = json.loads(store_.run("info", md.hash[:8], "--json").out)
    assert (as_json["read_dtype"], as_json["scales_nbytes"], as_json["block_size"]) == ("float16", 920, 16 << 20)
    stats = store_.run("stats", md.hash[:8])
    assert stats.code == 0, stats.err
    written = small_metadata(dtype="float8_e4m3", data={"name": "with stats"})
    write_cache(tmp_path / "other", written, stats=True)
    sidecar = ss.open(root / md.hash).stats
    reference = ss.open(tmp_path / "other" / written.hash).stats
    assert sidecar is not None and reference is not None
    for key in ("count", "mean", "var", "norm_mean", "norm_sq_mean"):
        np.testing.assert_array_equal(sidecar[key], reference[key])  # the same data: the same sums
    copy = writable_copy(root / md.hash, tmp_path / "broken")
    data = bytearray((copy / "scales000001.bin").read_bytes())
    data[7] ^= 1
    (copy / "scales000001.bin").write_bytes(bytes(data))
    verify = store_.run("verify", str(copy))
    assert verify.code == 1
    assert f"{copy / 'scales000001.bin'}: xxh3_128 expected" in verify.err
    assert f"; block 0 (bytes 0-{len(data) - 1}) differs" in verify.err


def test_info_of_a_cache_of_sites_says_what_each_layer_holds():
    """Protocol 3.2: `info` prints a line of sites, and `info --json` lists them."""
    golden = Path(__file__).resolve().parents[1] / "data" / "golden-3.2"
    (cache,) = golden.iterdir()
    command = [sys.executable, "-m", "saev_shards", "info", str(cache)]
    r = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fields = dict(line.split(None, 1) for line in r.stdout.splitlines() if line and not line.startswith(" "))
    assert fields["protocol"] == "3.2" and fields["layers"] == "[9, 2]"
    assert fields["sites"] == "9 blocks.1.mlp:input, 2 blocks.1.mlp:output"
    info = json.loads(subprocess.run([*command, "--json"], check=True, capture_output=True, text=True).stdout)
    assert info["sites"] == ["blocks.1.mlp:input", "blocks.1.mlp:output"]
