"""The command line on hostile caches: `info`, `info --json`, `ls` and `verify` exit 0, 1 or 3
only (never 5, "internal error"), never hang, and never print a raw control character."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import saev_shards as ss

from ..support.caches import small_metadata, write_cache
from ..support.hostile import Raw, hashed_copy, make_pristine, nested, random_case, render

#: Bytes a terminal may act on: C0 but newline, DEL, C1 (UTF-8 encoded), bidi overrides and
#: line separators (UTF-8 encoded), and any invalid UTF-8 (lone surrogates written raw).
RAW_CONTROL = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xa8-\xae]|\xe2\x81[\xa6-\xa9]")
ALLOWED_EXITS = {0, 1, 3}
#: Random damaged caches run through the commands in one interpreter: fast sample and slow suite.
FAST_RANDOM = 12
SLOW_RANDOM = 150


@dataclass
class Run:
    code: int
    out: bytes
    err: bytes


def saev_shards(*args: str) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards", *args], capture_output=True, timeout=60, env=env, check=False
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def assert_safe(run: Run, what: str) -> None:
    assert run.code in ALLOWED_EXITS, (what, run.code, run.err[-500:])
    assert b"internal error" not in run.err and b"Traceback" not in run.err, (what, run.err[-500:])
    for stream in (run.out, run.err):
        found = RAW_CONTROL.search(stream)
        assert found is None, (what, stream[max(0, found.start() - 40) : found.end() + 40])
        stream.decode("utf-8")  # valid UTF-8: no raw surrogates


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Caches issue 10 reported: two that open and verify with extreme values, several that do not."""
    base = tmp_path_factory.mktemp("cli-hostile")
    good = base / "good"
    extreme = small_metadata(
        family="clip\x1b[31m\u202e",
        ckpt="\x1b]0;pwned\x07ckpt\x9b2J\nsecond line\x00",
        dataset="/data/\x1b[2J",
        layers=(2**63 - 1, -(2**63)),
        n_examples=6,
        data={"n": 2**64 - 1, "m": -(2**63), "deep": json.loads(render(nested(61))), "long": "x" * 10_000},
    )
    write_cache(good, extreme, stats=True, labels=True, text=True)
    plain = small_metadata(n_examples=6)
    write_cache(good, plain)
    bad = base / "bad"
    bad.mkdir()
    md = json.loads((good / plain.hash / "metadata.json").read_text())
    out = {"extreme": good / extreme.hash, "plain": good / plain.hash}
    reported = {
        "data above 2**64": {**md, "data": {"n": 2**64 + 1}},
        "data nested 260 deep": {**md, "data": nested(259)},
        "layers 2**64": {**md, "layers": [2**64, 1]},
        "family a lone surrogate": Raw(render({**md, "family": "X"}).replace('"X"', '"\\ud800"')),
    }
    for name, metadata in reported.items():
        out[name] = hashed_copy(good / plain.hash, bad, metadata)
    fifo = hashed_copy(good / plain.hash, bad, {**md, "ckpt": "fifo"})
    (fifo / "shards.json").unlink()
    os.mkfifo(fifo / "shards.json")
    out["shards.json a FIFO"] = fifo
    zero = hashed_copy(good / plain.hash, bad, {**md, "ckpt": "zero"})
    (zero / "metadata.json").rename(zero / "real.json")
    (zero / "metadata.json").symlink_to("/dev/zero")
    out["metadata.json a link to /dev/zero"] = zero
    return out


def test_extreme_values_that_open_print_safely(caches: dict[str, Path]) -> None:
    for command in (["info"], ["info", "--json"], ["verify"]):
        run = saev_shards(command[0], str(caches["extreme"]), *command[1:])
        assert_safe(run, f"{command} on extreme values")
        assert run.code == 0, (command, run.err)
    info = json.loads(saev_shards("info", str(caches["extreme"]), "--json").out)
    assert info["layers"] == [2**63 - 1, -(2**63)] and info["data"]["n"] == 2**64 - 1
    assert info["ckpt"] == "\x1b]0;pwned\x07ckpt\x9b2J\nsecond line\x00"  # exact in JSON, escaped on screen
    assert info["family"] == "clip\x1b[31m\u202e"


def test_reported_caches_are_problems_not_internal_errors(caches: dict[str, Path]) -> None:
    whats, commands = [], []
    for name, path in caches.items():
        for command in (["info", str(path)], ["info", str(path), "--json"], ["verify", str(path)]):
            whats.append(f"{command[0]}{' --json' if '--json' in command else ''} on {name}")
            commands.append(command)
    for what, run in drive(commands, whats):
        assert_safe(run, what)
        assert run.code == (0 if what.endswith(("extreme", "plain")) else 1), (what, run.err)


def test_ls_over_hostile_caches(caches: dict[str, Path]) -> None:
    roots = sorted({str(p.parent) for p in caches.values()})
    for args in (["ls", *roots], ["ls", *roots, "--json"]):
        run = saev_shards(*args)
        assert_safe(run, " ".join(args[:1] + args[-1:]))
        assert run.code == 1  # the broken ones are listed as such
    listing = json.loads(run.out)
    broken = {Path(c["path"]).name for root in listing for c in root["caches"] if not c["ok"]}
    assert broken == {p.name for name, p in caches.items() if name not in ("extreme", "plain")}
    assert b"\\x1b]0;pwned\\x07ckpt\\x9b2J\\x0asecond line\\x00" in saev_shards("ls", str(caches["extreme"].parent)).out


# Many commands over many caches in one interpreter: each `main()` call is a whole command
# (parsing, output escaping, exit code), without an interpreter start per command.
_DRIVER = textwrap.dedent(
    """
    import io, json, signal, sys
    from saev_shards.cli import main

    def hang(signum, frame):
        raise SystemExit("hang: " + repr(args))
    signal.signal(signal.SIGALRM, hang)
    results = []
    for args in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = out, err
        signal.alarm(20)
        code = main(args)
        signal.alarm(0)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        results.append([code, out.getvalue(), err.getvalue()])
    sys.stdout.write(json.dumps(results, ensure_ascii=True))
    """
)


def run_random_sample(base: Path, n_caches: int, seed: int) -> list[tuple[str, Run]]:
    pristine = make_pristine(base / "pristine")
    rng = random.Random(seed)
    commands: list[list[str]] = []
    whats: list[str] = []
    for i in range(n_caches):
        cache = rng.choice(pristine)
        docs = {n: json.loads((cache.path / n).read_bytes()) for n in cache.json_files}
        name, data, what = random_case(rng, docs)
        copy = base / f"case{i}" / cache.path.name
        copy.parent.mkdir()
        os.rename(cache.path, copy)  # move, damage, copy back: cheaper than copying every case
        try:
            original = (copy / name).read_bytes()
            (copy / name).write_bytes(data)
            keep = base / "damaged" / f"{i}" / cache.path.name
            keep.parent.mkdir(parents=True)
            os.system(f"cp -r {copy} {keep}")
            (copy / name).write_bytes(original)
        finally:
            os.rename(copy, cache.path)
        for command in (["info", str(keep)], ["info", str(keep), "--json"], ["verify", str(keep)]):
            commands.append(command)
            whats.append(f"{command[0]} on case {i} of seed {seed}: {what}")
    commands.append(["ls", *sorted(str(p) for p in (base / "damaged").iterdir())])
    whats.append("ls over every damaged cache")
    return drive(commands, whats)


def drive(commands: list[list[str]], whats: list[str]) -> list[tuple[str, Run]]:
    """Run ``commands`` through `cli.main` in one fresh interpreter; ``(what, Run)`` for each."""
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(commands)], capture_output=True, timeout=600, check=True
    )
    results: list[Any] = json.loads(proc.stdout)
    return [(what, Run(code, out.encode("utf-8", "surrogatepass"), err.encode("utf-8", "surrogatepass")))
            for what, (code, out, err) in zip(whats, results, strict=True)]  # fmt: skip


def test_commands_on_random_hostile_caches(tmp_path: Path) -> None:
    results = run_random_sample(tmp_path, FAST_RANDOM, 0)
    for what, run in results:
        assert_safe(run, what)
    assert {run.code for _, run in results} >= {1}


@pytest.mark.slow
def test_commands_on_many_random_hostile_caches(tmp_path: Path) -> None:
    for what, run in run_random_sample(tmp_path, SLOW_RANDOM, random.randrange(1 << 32)):
        assert_safe(run, what)


# --------------------------------------------------------------------------------------
# odd references: what a user can type where a cache is named

#: Reference -> what the error says. Before the fix the long ones raised a raw OSError
#: ("File name too long"), and an empty reference named the working directory.
ODD_REFERENCES = {
    "x" * 5_000: "5,000 bytes long, more than a path may be",
    "a/" + "y" * 300: "holds a name of 300 bytes, more than a file name may be",
    "3f2a\x00": "holds a NUL character",
    "": "found an empty reference",
    "   ": "found an empty reference",
}


@pytest.mark.parametrize("ref", list(ODD_REFERENCES), ids=["5000 chars", "300-char name", "NUL", "empty", "spaces"])
def test_odd_references_are_refused_with_a_clear_error(tmp_path: Path, ref: str) -> None:
    import subprocess

    from saev_shards import store

    says = ODD_REFERENCES[ref]
    for call in (ss.open, store.resolve):
        with pytest.raises(ss.CacheRefError, match=says):
            call(ref)
    from saev_shards.convert import convert

    with pytest.raises(ss.CacheRefError, match=says):
        convert(ref, root=tmp_path / "root")
    if "\x00" in ref:
        return  # a command line cannot hold a NUL byte: the library calls above are the whole case
    env = {**os.environ, "SAEV_SHARDS_ROOT": str(tmp_path / "root")}
    for command in (["info", ref], ["verify", ref], ["rm", ref, "--yes", "--force"], ["convert", ref]):
        done = subprocess.run(
            [sys.executable, "-m", "saev_shards", *command], check=False, capture_output=True, text=True, env=env
        )
        assert done.returncode == 3, (command[0], done.stderr)
        assert done.stderr.count("\n") == 1 and says in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr) < 400  # the reference is quoted to a bounded length
