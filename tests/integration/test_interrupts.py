"""Ctrl-C stops every long command at once, whatever its threads are doing.

A thread that reads ahead (a pickle shard being loaded, the next chunk of a shuffle's
source) may block for minutes on a slow or hung filesystem. Each test patches that read to
block for two minutes (after touching a marker file), sends SIGINT once it blocks, and
requires exit code 130 with the usual one line well before the read would end. Before the
fix both commands waited for the blocked thread (`ThreadPoolExecutor` joins its threads on
the way out, and again at interpreter exit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..support.caches import small_metadata, write_cache
from ..support.cli import cli_with_ctrl_c
from ..support.sources import pickle_source

#: Far longer than any wait below: the blocked read never ends on its own within the test.
BLOCK_SECONDS = 120
#: How long an interrupted command may take to end here (a hang bound, not a timing).
STOP_SECONDS = 20.0

_BLOCK = """
import importlib, pathlib, time
_m = importlib.import_module({module!r})
_original = _m.{name}
def _blocking(*args, **kwargs):
    if {condition}:
        pathlib.Path({marker!r}).touch()
        time.sleep({seconds})
    return _original(*args, **kwargs)
_m.{name} = _blocking
"""


def _interrupt(args: list[str], marker: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            pytest.fail(f"the command never reached the blocking read (exit {proc.returncode}): {err}")
        time.sleep(0.01)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {STOP_SECONDS} s after Ctrl-C: it waits for its blocked reading thread")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_ctrl_c_stops_convert_while_its_read_ahead_thread_blocks(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src", per_shard=(2, 2, 2))
    marker = tmp_path / "blocked"
    setup = _BLOCK.format(
        module="saev_shards.convert.pickle_shards",
        name="load_shard",
        condition="args[0].path.name.startswith('shard_0003')",
        marker=str(marker),
        seconds=BLOCK_SECONDS,
    )
    args = cli_with_ctrl_c("convert", str(tmp_path / "src"), "--root", str(tmp_path / "root"), setup=setup)
    done = _interrupt(args, marker)
    assert done.returncode == 130, done.stderr
    assert done.stderr.endswith(
        "saev-shards: interrupted; the sealed shards are kept: run the same command again to resume\n"
    )


def test_ctrl_c_stops_shuffle_while_its_reading_thread_blocks(tmp_path: Path) -> None:
    md = small_metadata(n_examples=40, d_model=16)
    write_cache(tmp_path / "shards", md)
    marker = tmp_path / "blocked"
    setup = _BLOCK.format(
        module="saev_shards.shuffle.scatter",
        name="_read",
        condition="args[2] == 1",  # the second chunk: the first is gathered meanwhile
        marker=str(marker),
        seconds=BLOCK_SECONDS,
    )
    args = cli_with_ctrl_c(
        "shuffle", str(tmp_path / "shards" / md.hash), "--to", str(tmp_path / "out"), "--memory", "64K",
        "--no-progress", setup=setup,
    )  # fmt: skip
    done = _interrupt(args, marker)
    assert done.returncode == 130, done.stderr
    assert "saev-shards: interrupted" in done.stderr
