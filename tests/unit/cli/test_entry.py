"""cli.entry: the command line in process: every command found, every error one line on stderr
with its documented exit code, output passed through the escaping writer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from saev_shards.cli import _common, entry

from ...support.caches import small_metadata, write_cache


def test_a_command_runs_and_its_output_is_escaped(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    md = small_metadata(n_examples=3, family="evil\x1b[31m")
    write_cache(root, md)
    assert entry.main(["info", md.hash[:8], "--root", str(root)]) == _common.EXIT_OK
    out = capsys.readouterr().out
    assert md.hash in out and "evil\\x1b[31m" in out and "\x1b" not in out
    assert sys.stdout is not None and not isinstance(sys.stdout, _common.EscapingWriter)  # given back


def test_errors_are_one_line_with_their_exit_code(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = entry.main(["info", "ffff", "--root", str(root)])
    assert code == _common.EXIT_NOT_FOUND
    err = capsys.readouterr().err
    assert err.startswith("saev-shards: error: ") and err.count("\n") >= 1
    assert entry.main(["info", "--root", str(root / "missing"), "ab"]) == _common.EXIT_NOT_FOUND
    capsys.readouterr()


def test_every_command_is_registered() -> None:
    parser = entry.build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["no-such-command"])
    assert info.value.code == 2
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    wanted = {"ls", "info", "verify", "stage", "rm", "clean", "shuffle", "convert", "dump", "run", "doctor"}
    assert wanted <= set(sub.choices)
