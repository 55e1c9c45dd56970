"""`saev-shards convert` in subprocesses: output, exit codes, bad input, and SIGKILL then resume."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import saev_shards as ss

from ..support.caches import small_metadata, tree_bytes, write_cache
from ..support.sources import assert_converted, npy_source, pickle_source, zarr_source

REPO = str(Path(__file__).resolve().parents[2])


@dataclass
class Result:
    code: int
    out: str
    err: str


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAEV_")}
    env["PYTHONPATH"] = REPO
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    proc = subprocess.run(
        [sys.executable, "-m", "saev_shards", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env if env is not None else _env(),
        timeout=120,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def one_line(r: Result) -> str:
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1, r.err
    assert "Traceback" not in r.err
    return lines[0]


def test_convert_prints_the_mapping_and_the_path_last(tmp_path: Path) -> None:
    expected = pickle_source(tmp_path / "src")
    root = tmp_path / "root"
    r = cli("convert", str(tmp_path / "src"), env=_env(SAEV_SHARDS_ROOT=str(root)))
    assert r.code == 0, r.err
    last = r.out.splitlines()[-1]
    shards = ss.open(last)
    assert Path(last).parent == root
    assert_converted(shards, expected)
    assert "sha256" not in r.err and "3 of 3 shards carry a checksum" in r.out
    assert "mapping    tokens: every example padded with zeros to T=9" in r.out
    again = cli("convert", str(tmp_path / "src"), "--root", str(root))
    assert again.code == 0 and "already published" in again.out and again.out.splitlines()[-1] == last


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    npy_source(tmp_path / "a.npy")
    r = cli("convert", str(tmp_path / "a.npy"), "--root", str(tmp_path / "root"), "--dry-run", "--layers", "4,8,12")
    assert r.code == 0, r.err
    assert "layers [4, 8, 12] (--layers)" in r.out
    assert r.out.splitlines()[-1].startswith("not written (dry run): ")
    assert not (tmp_path / "root").exists()


def test_user_mistakes_are_one_line_with_their_exit_codes(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src")
    npy_source(tmp_path / "a.npy")
    root = ["--root", str(tmp_path / "root")]
    cases = [
        # (args, env, exit code, words in the message)
        ((str(tmp_path / "nope"), *root), None, 3, "no such file or directory"),
        ((str(tmp_path / "src"),), _env(), 2, "no shards root"),
        ((str(tmp_path),), None, 2, "not a source kind convert recognises"),
        ((str(tmp_path / "a.npy"), "--from", "pickle", *root), None, 2, "does not look like a pickle source"),
        ((str(tmp_path / "a.npy"), "--layers", "1,2", *root), None, 2, "expected 3 layer numbers"),
        ((str(tmp_path / "a.npy"), "--max-tokens", "0", *root), None, 2, "expected a positive integer"),
        ((str(tmp_path / "src"), "--layers", "1,2", *root), None, 2, "pickle shards name their layers"),
        ((str(tmp_path / "a.npy"), "--dtype", "int8", *root), None, 2, "invalid choice"),
    ]
    for args, env, code, words in cases:
        r = cli("convert", *args, env=env if env is not None else _env())
        assert r.code == code, (args, r.code, r.err)
        line = r.err.strip().splitlines()[-1]
        assert words in line, (args, r.err)
        if code != 2 or "invalid choice" not in words:
            assert "internal error" not in r.err and "Traceback" not in r.err


def test_a_2d_npy_of_token_vectors_is_refused_with_the_reshape_that_converts_it(tmp_path: Path) -> None:
    """`(n_tokens, d)` is what many people have: the refusal says how to make it (N, L, T, D),
    and doing what it says converts it."""
    tokens = np.random.default_rng(0).standard_normal((30, 8)).astype(np.float32)
    np.save(tmp_path / "tokens.npy", tokens)
    root = ["--root", str(tmp_path / "root"), "--no-progress"]
    r = cli("convert", str(tmp_path / "tokens.npy"), *root)
    line = one_line(r)
    assert r.code == 1 and "found (30, 8)" in line and "a[:, None, None, :]" in line, line
    assert "a.reshape(n_examples, 1, T, d_model)" in line, line
    np.save(tmp_path / "examples.npy", tokens[:, None, None, :])  # what the message says
    r = cli("convert", str(tmp_path / "examples.npy"), *root)
    assert r.code == 0, r.err
    shards = ss.open(r.out.splitlines()[-1])
    np.testing.assert_array_equal(shards[:, 0, 0], tokens.astype(np.float16))


def test_corrupt_checksum_and_float16_overflow(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src")
    shard = tmp_path / "src" / "shard_0001.pkl.gz"
    data = bytearray(shard.read_bytes())
    data[-12] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = cli("convert", str(tmp_path / "src"), "--root", str(tmp_path / "root"))
    assert r.code == 1
    assert "shard_0001.pkl.gz: sha256 expected" in one_line(r)

    big = np.full((3, 1, 2, 4), 1e6, np.float32)
    np.save(tmp_path / "big.npy", big)
    r = cli("convert", str(tmp_path / "big.npy"), "--root", str(tmp_path / "root"))
    assert r.code == 1
    line = one_line(r)
    assert "not finite after the cast to float16" in line and "--dtype float32" in line and "--allow-nonfinite" in line
    r = cli("convert", str(tmp_path / "big.npy"), "--root", str(tmp_path / "root"), "--dtype", "float32")
    assert r.code == 0, r.err
    np.testing.assert_array_equal(ss.open(r.out.splitlines()[-1])[:], big)


def test_not_carried_over_goes_to_stderr(tmp_path: Path) -> None:
    zarr_source(tmp_path / "run")
    r = cli("convert", str(tmp_path / "run"), "--root", str(tmp_path / "root"), "--max-tokens", "5")
    assert r.code == 0, r.err
    assert "ONE cache" in r.out
    assert any(line.startswith("saev-shards: warning: ") and "truncated" in line for line in r.err.splitlines())
    assert "not carried over" not in r.out


def test_a_language_model_cache_to_saev_says_which_family_and_each_drop_once(tmp_path: Path) -> None:
    """A dumped language model (family bert, columns and text) -> saev: the refusal says saev
    knows vision families only and which to pick; with it, each dropped thing is one line."""
    md = small_metadata(family="bert", ckpt="sentence-transformers/all-MiniLM-L6-v2", n_examples=4, dtype="float16")
    write_cache(tmp_path / "src", md, lengths=np.array([5, 3, 5, 2]), stats=True)
    src = str(tmp_path / "src" / md.hash)
    root = str(tmp_path / "saev" / "shards")
    r = cli("convert", src, "--to", "saev", "--root", root)
    assert r.code == 2 and "saev knows only vision model families" in r.err and "--family clip" in r.err, r.err
    assert "family 'bert' is not one of them (a language model's cache never is)" in r.err
    r = cli("convert", src, "--to", "saev", "--family", "clip", "--root", root)
    assert r.code == 0, r.err
    warnings = [line for line in r.err.splitlines() if line.startswith("saev-shards: warning: ")]
    assert "saev-shards: warning: column lengths not carried over (protocol 2.1 holds activations only)" in warnings
    assert "saev-shards: warning: stats.json not carried over (saev has no room for statistics)" in warnings
    assert all(line.count("not carried over") <= 1 for line in warnings), warnings
    with pytest.warns(ss.ProtocolWarning):
        assert ss.open(r.out.splitlines()[-1]).metadata.family == "clip"


# --------------------------------------------------------------------------------------
# SIGKILL at a few points, then the same command again


_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import saev_shards.convert.base as base
    import saev_shards.cli.convert as cli_convert
    import importlib
    writer = importlib.import_module("saev_shards.writer.finalize")  # the module, not the function
    from saev_shards.cli import main

    base.CHUNK_BYTES = int(os.environ["TEST_CHUNK_BYTES"])  # many small chunks
    point = os.environ["TEST_KILL_AT"]
    if point == "publish":
        def publish_dir(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        writer.publish_dir = publish_dir
    else:
        real_run = cli_convert.run
        def run(prepared, **kwargs):
            chunks = prepared.source.chunks
            def killing(start, report):
                for i, chunk in enumerate(chunks(start, report)):
                    if i == int(point):
                        os.kill(os.getpid(), signal.SIGKILL)
                    yield chunk
            prepared.source.chunks = killing
            return real_run(prepared, **kwargs)
        cli_convert.run = run
    sys.exit(main(sys.argv[1:]))
    """
)


def _killed(args: list[str], point: str, chunk_bytes: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, "convert", *args],
        check=False,
        capture_output=True,
        text=True,
        env=_env(TEST_KILL_AT=point, TEST_CHUNK_BYTES=str(chunk_bytes)),
        timeout=120,
    )
    assert proc.returncode == -9, (point, proc.returncode, proc.stderr)


def _kill_and_resume(
    tmp_path: Path, src: Path, extra: list[str], points: list[str], chunk_bytes: int, resumes: str = ""
) -> None:
    reference = cli("convert", str(src), "--root", str(tmp_path / "reference"), *extra)
    assert reference.code == 0, reference.err
    want = tree_bytes(Path(reference.out.splitlines()[-1]))
    for point in points:
        root = tmp_path / f"killed-{point}"
        args = [str(src), "--root", str(root), *extra]
        _killed(args, point, chunk_bytes)
        assert not any(p.name[0] != "." for p in root.iterdir()), "nothing may be published by a killed run"
        r = cli("convert", *args)
        assert r.code == 0, (point, r.err)
        if point == resumes:  # enough chunks passed the writer's bounded queue to seal shards
            assert "resuming at example" in r.out, r.out
        assert tree_bytes(Path(r.out.splitlines()[-1])) == want, point


def test_pickle_killed_at_a_few_points_resumes_byte_identical(tmp_path: Path) -> None:
    pickle_source(tmp_path / "src", per_shard=(6, 5, 7, 6), max_len=8)
    # 24 examples, 2 layers x 8 tokens x 8 dims; writer shards of 3 examples; 2-example chunks
    extra = ["--patches-per-shard", str(3 * 2 * 8)]
    _kill_and_resume(
        tmp_path, tmp_path / "src", extra, ["0", "5", "11", "publish"], chunk_bytes=2 * 2 * 8 * 8 * 4, resumes="11"
    )


@pytest.mark.slow
def test_zarr_and_npy_killed_resume_byte_identical(tmp_path: Path) -> None:
    zarr_source(tmp_path / "run", n=12, shards=(5, 4, 3))
    extra = ["--patches-per-shard", str(2 * 10 * 2)]
    _kill_and_resume(tmp_path / "z", tmp_path / "run", extra, ["0", "3", "publish"], chunk_bytes=2 * 10 * 8 * 4)
    npy_source(tmp_path / "a.npy", (20, 2, 4, 8))
    extra = ["--patches-per-shard", str(2 * 4 * 3), "--dtype", "bfloat16"]
    _kill_and_resume(tmp_path / "n", tmp_path / "a.npy", extra, ["2", "6", "publish"], chunk_bytes=2 * 4 * 8 * 4)


def test_missing_optional_package_names_the_extra(tmp_path: Path) -> None:
    zarr_source(tmp_path / "run")
    code = (
        "import sys\nsys.modules['zarr'] = None  # as if not installed\n"
        "from saev_shards.cli import main\n"
        f"sys.exit(main(['convert', {str(tmp_path / 'run')!r}, '--root', {str(tmp_path / 'root')!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=_env(), timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    line = one_line(Result(proc.returncode, proc.stdout, proc.stderr))
    assert "converting zarr activation logs needs zarr" in line and f"pip install -e '{REPO}[convert]'" in line


def test_convert_to_float8_and_back(tmp_path: Path) -> None:
    """`convert --dtype float8_e4m3` from a source of another kind (.npy), then back to float16:
    one byte per value and a scale per vector, the values within the rule's bound."""
    values = npy_source(tmp_path / "a.npy")
    root = str(tmp_path / "root")
    r = cli("convert", str(tmp_path / "a.npy"), "--root", root, "--dtype", "float8_e4m3", "--no-progress")
    assert r.code == 0, r.err
    f8 = ss.open(r.out.splitlines()[-1])
    assert (f8.dtype, f8.metadata.protocol) == ("float8_e4m3", ss.PROTOCOL)
    assert f8.manifest.shards[0].nbytes == f8.metadata.shard_n_examples(0) * f8.metadata.example_nbytes
    assert "float8_e4m3" in r.out and "of activations" in r.out
    back = cli("convert", str(f8.path), "--root", root, "--dtype", "float16", "--no-progress")
    assert back.code == 0, back.err
    f16 = ss.open(back.out.splitlines()[-1])
    assert f16.dtype == "float16" and f16.path != f8.path
    assert "dequantized to float16" in back.err + back.out
    x = values.acts
    _, scales = ss.codecs.float8.quantize_numpy(x)
    bound = ss.codecs.float8.error_bound(x, scales) + np.abs(x) * 2.0**-11 + 2.0**-25  # and float16's rounding
    assert (np.abs(f16[:].astype(np.float64) - x) <= bound).all()
