"""Concurrency: 8 reader processes open, read and verify every cache in a root, and a
ninth runs ``saev-shards verify`` in a loop, while caches are written and published in the
same root. A cache appears at once and whole: before its rename it is not found, after it
opens and verifies, and it never goes back; no reader meets any other error.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import numpy as np

import saev_shards as ss
from saev_shards import store
from saev_shards.cli import main as cli_main

from ..support.caches import logical_tensor
from ..support.faults import Child, fault_metadata, write_run

N_READERS = 8
#: Caches written while the readers run (the first is there before they start).
MDS = [fault_metadata(data={"name": "synthetic", "run": i}) for i in range(4)]


def read_loop(root: Path, stop: Path) -> str:
    """Open, read and verify every cache (listed, and each expected hash) until ``stop``
    exists and every cache has been seen; returns counts and every unexpected event as JSON."""
    seen: set[str] = set()
    counts = {"verified": 0, "not_yet": 0, "listed": 0}
    problems: list[str] = []
    deadline = time.monotonic() + 120
    while not (stop.exists() and len(seen) == len(MDS)) and time.monotonic() < deadline:
        for entry in store.list_caches(root):
            counts["listed"] += 1
            if not entry.ok:
                problems.append(f"listed {entry.hash[:12]} does not open: {entry.problem}")
        for md in MDS:
            try:
                shards = ss.open(root / md.hash)
            except ss.CacheNotFoundError:
                counts["not_yet"] += 1
                if md.hash in seen:
                    problems.append(f"{md.hash[:12]} disappeared after it was published")
                continue
            except Exception as err:
                problems.append(f"{md.hash[:12]}: {type(err).__name__}: {err}")
                continue
            try:
                if not np.array_equal(shards[:], logical_tensor(md)):
                    problems.append(f"{md.hash[:12]}: read values differ from what was written")
                shards.verify()
            except Exception as err:
                problems.append(f"{md.hash[:12]} after open: {type(err).__name__}: {err}")
                continue
            seen.add(md.hash)
            counts["verified"] += 1
    if len(seen) != len(MDS):
        problems.append(f"saw {len(seen)} of {len(MDS)} caches published before the deadline")
    return json.dumps({"counts": counts, "problems": problems})


def verify_loop(root: Path, stop: Path) -> str:
    """``saev-shards verify`` on every expected cache until ``stop``: exit 0 once published,
    3 (not found) before; never anything else, never 3 again after a 0."""
    published: set[str] = set()
    codes: dict[int, int] = {}
    problems: list[str] = []
    deadline = time.monotonic() + 120
    while not (stop.exists() and len(published) == len(MDS)) and time.monotonic() < deadline:
        for md in MDS:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main(["verify", str(root / md.hash)])
            codes[code] = codes.get(code, 0) + 1
            if code == 0:
                published.add(md.hash)
            elif code != 3 or md.hash in published:
                problems.append(f"verify {md.hash[:12]} exited {code}: {err.getvalue().strip()}")
    return json.dumps({"codes": codes, "problems": problems})


def test_readers_and_verify_while_caches_are_published(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    write_run(root, MDS[0], resume=False)
    stop = tmp_path / "stop"
    children = [Child(read_loop, root, stop) for _ in range(N_READERS)]
    children.append(Child(verify_loop, root, stop))
    for md in MDS[1:]:  # written here, published while the others read
        write_run(root, md, resume=False, pause=0.005)
    stop.touch()
    reports = []
    for child in children:
        outcome = child.wait()
        assert outcome.kind == "ok", outcome
        reports.append(json.loads(outcome.detail))
    problems = [p for r in reports for p in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    assert all(r["counts"]["verified"] >= len(MDS) for r in reports[:N_READERS])
    assert reports[-1]["codes"].get("0", 0) >= len(MDS)
    assert sorted(p.name for p in root.iterdir()) == sorted(md.hash for md in MDS)
