"""A newcomer's way in: `make dist` builds the sdist and the wheel; the wheel, installed into a
fresh virtual environment that has never seen this checkout, reads and writes caches without
torch, its console script works, and with the ``[torch]`` extra a loader runs.

Installing next to what is there (slow, `make test-all`): the metadata declares ranges, so
the wheel goes into an environment that already holds numpy 2.2, ml-dtypes 0.5,
matplotlib 3.10 and torch 2.13.0 without pip changing any of them, and works there (a
cache, a report, a loader); and into one at the OLDEST versions the metadata allows for the
core (numpy, orjson, xxhash, ml-dtypes, read from the wheel's own Requires-Dist), where the
core's unit tests pass and float8_e4m3 is quantized to the same bytes as with the pinned
versions. These download from PyPI what pip's cache (left on, as for every install here)
does not hold yet.

pip finds torch where it finds it for every install on this machine (its configured wheel
folder holds the CPU wheel), so the ``[torch]`` journey costs an unzip, not a download; the
installs that may pull torch pass ``-c constraints.txt`` (torch==2.13.0), as the Makefile
does: the metadata's ``torch>=2.13`` alone would take a newer, CUDA build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

WRITE_AND_READ = """
import sys
import numpy as np
import saev_shards as ss

assert "site-packages" in ss.__file__, ss.__file__  # the wheel, not the checkout
md = ss.Metadata(family="clip", ckpt="ViT-S-16/synthetic", layers=(6, 11), patches_per_ex=4, cls_token=True,
                 d_model=8, n_examples=10, patches_per_shard=40, data={"name": "journey"}, dataset="journey")
acts = np.arange(10 * 2 * 5 * 8, dtype=np.float32).reshape(10, 2, 5, 8) / 100
with ss.ShardWriter("shards", md, stats=True) as w:
    w.write(acts)
shards = ss.open(f"shards/{md.hash}")
np.testing.assert_array_equal(shards[:], acts.astype(np.float16))
assert shards.verify() > 0 and shards.stats is not None
assert "torch" not in sys.modules
print(shards.path)
"""

LOADER_WITHOUT_TORCH = """
import sys
import saev_shards as ss
from saev_shards.loaders import ShuffledLoader
try:
    ShuffledLoader(sys.argv[1], batch_size=4, layers=11)
except ss.MissingDependencyError as err:
    print(err)
"""

LOADER = """
import sys
import numpy as np
import saev_shards as ss
from saev_shards.loaders import ShuffledLoader

shards = ss.open(sys.argv[1])
seen = 0
for batch in ShuffledLoader(shards, batch_size=4, layers=11, seed=0):
    expected = shards[batch.examples.numpy(), 1, batch.tokens.numpy()]
    np.testing.assert_array_equal(batch.acts.numpy(), expected)
    seen += len(batch)
assert seen == 10 * 4, seen  # every content token of layer 11, once
print("loader ok", seen)
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `make dist` builds (the sdist beside it)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        ["make", "-s", "dist", f"DIST={out}"], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "project.license` as a TOML table is deprecated" not in proc.stdout + proc.stderr
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return wheels[0]


CONSTRAINTS = REPO / "constraints.txt"


def fresh_venv(where: Path, *requirements: str) -> Path:
    """A new virtual environment (no site packages of ours) with ``requirements`` installed by pip."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    if requirements:
        pip_install(python, *requirements)
    return python


#: Wheels these tests downloaded, kept for the next run. pip's own HTTP cache keeps nothing
#: on the development machines (the registry answers without the validators or lifetimes a
#: cache needs), so every run would download them again; `pip download` into this folder
#: skips the files already there, and the install then reads them from it.
WHEELHOUSE = Path(os.environ.get("SAEV_SHARDS_TEST_WHEELS", Path.home() / ".cache" / "saev-shards-test-wheels"))


def pip_install(python: Path, *args: str) -> None:
    """pip (this environment's, aimed at ``python``'s) installs ``args``, the files first
    downloaded into `WHEELHOUSE` (or found there) and then installed from it alone."""
    env = {k: v for k, v in os.environ.items() if k != "PIP_NO_CACHE_DIR"}
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    # The download does not see what the environment holds, so a torch range would fetch the
    # newest (CUDA) torch: it is held to constraints.txt's; the install then decides alone.
    torch_pin = WHEELHOUSE / "torch-constraint.txt"
    torch_pin.write_text(
        "".join(line + "\n" for line in CONSTRAINTS.read_text().splitlines() if line.startswith("torch=="))
    )
    download = ["download", "--dest", str(WHEELHOUSE), "-c", str(torch_pin)]
    for step in (download, ["install", "--no-index", "--find-links", str(WHEELHOUSE)]):
        proc = subprocess.run(
            [*pip, *step, "--quiet", *args], capture_output=True, text=True, timeout=1500, check=False, env=env
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def installed(python: Path) -> dict[str, str]:
    """Every distribution in ``python``'s environment -> its version."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "list", "--format=json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(proc.stdout)}


def run(python: Path, code: str, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAEV_", "PYTHON"))}
    proc = subprocess.run(
        [str(python), "-c", textwrap.dedent(code), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_wheel_without_torch_writes_reads_and_says_how_to_get_the_loaders(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path, str(wheel))
    work = tmp_path / "work"
    work.mkdir()
    path = run(python, WRITE_AND_READ, cwd=work).strip()
    info = subprocess.run(
        [str(python.parent / "saev-shards"), "info", path], capture_output=True, text=True, timeout=120, check=False
    )
    assert info.returncode == 0 and "(10, 2, 5, 8)" in info.stdout, info.stdout + info.stderr
    message = run(python, LOADER_WITHOUT_TORCH, path, cwd=work).strip()
    # Installed from a wheel, not an index: the hint lists the extra's requirements, as ranges.
    assert message.endswith("install it with: pip install 'torch>=2.13' (the [torch] extra of saev-shards)"), message


def test_the_wheel_declares_ranges_and_an_spdx_license(wheel: Path) -> None:
    """Exact versions belong to constraints.txt (the environments make builds), not to the
    wheel: every requirement is a lower bound; the license is an SPDX expression (the table
    form is deprecated by setuptools and warned about at every build)."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(name).decode()
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert requires and not [r for r in requires if "==" in r.split(";")[0]], requires
    assert "License-Expression: MIT" in metadata
    pins = dict(line.split("==") for line in CONSTRAINTS.read_text().splitlines() if "==" in line)
    assert pins["torch"] == "2.13.0", "torch stays exactly on the CPU wheel of this machine"


@pytest.mark.slow
def test_the_wheel_with_the_torch_extra_runs_a_loader(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path, "-c", str(CONSTRAINTS), f"{wheel}[torch]")
    work = tmp_path / "work"
    work.mkdir()
    path = run(python, WRITE_AND_READ, cwd=work).strip()
    assert run(python, LOADER, path, cwd=work).strip() == "loader ok 40"


#: What a notebook or cluster environment already holds (older than constraints.txt's).
ALREADY_THERE = {"numpy": "2.2.6", "ml-dtypes": "0.5.4", "matplotlib": "3.10.9", "torch": "2.13.0"}

REPORT_AND_LOADER = """
import sys
import numpy as np
import saev_shards as ss
from saev_shards.convert import convert
from saev_shards.loaders import ShuffledLoader

shards = ss.open(sys.argv[1])
out = shards.report(progress=False).save("report.png")
assert out.stat().st_size > 10_000, out
seen = sum(len(b) for b in ShuffledLoader(shards, batch_size=4, layers=11, seed=0))
assert seen == 10 * 4, seen
f8 = ss.open(convert(shards.path, dtype="float8_e4m3", root="f8", progress=False).path)
np.testing.assert_allclose(f8[:], shards[:].astype(np.float32), rtol=1 / 16, atol=1e-3)
print("ok", np.__version__)
"""


@pytest.mark.slow
def test_the_wheel_installs_beside_what_is_there_and_changes_nothing(wheel: Path, tmp_path: Path) -> None:
    """An environment that already holds numpy 2.2, ml-dtypes 0.5, matplotlib 3.10 and torch
    2.13.0: pip installs the wheel with the torch and plot extras, changes none of them (nor
    anything else that was there), and a cache is written and read, a report drawn, a loader
    run and a float8 conversion read back there."""
    python = fresh_venv(tmp_path, *(f"{name}=={version}" for name, version in ALREADY_THERE.items()))
    before = installed(python)
    assert {name: before[name].split("+")[0] for name in ALREADY_THERE} == ALREADY_THERE
    pip_install(python, f"{wheel}[torch,plot]")  # the metadata alone: no constraints file
    after = installed(python)
    changed = {name: (v, after.get(name)) for name, v in before.items() if after.get(name) != v}
    assert not changed, changed
    assert "saev-shards" in after
    work = tmp_path / "work"
    work.mkdir()
    path = run(python, WRITE_AND_READ, cwd=work).strip()
    assert run(python, REPORT_AND_LOADER, path, cwd=work).strip() == "ok 2.2.6"


def lower_bounds(wheel: Path) -> dict[str, str]:
    """The core's requirements (no extra) from the wheel's METADATA: name -> lower bound."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        requires = re.findall(r"^Requires-Dist: (.*)$", zf.read(name).decode(), re.M)
    bounds = {}
    for requirement in requires:
        if "extra ==" in requirement:
            continue
        m = re.fullmatch(r"([\w.-]+)\s*>=\s*([\w.]+)", requirement.strip())
        assert m is not None, f"expected name>=version for a core requirement, found {requirement!r}"
        bounds[m.group(1).lower().replace("_", "-")] = m.group(2)
    return bounds


#: The unit tests of the core that need neither torch nor an optional extra; they run in the
#: oldest environment from a copy of tests/ (no checkout beside it: the wheel is imported).
CORE_TESTS = [
    "test_corruption.py", "test_errors.py", "fileio/test_locks.py", "fileio/test_publish.py", "fileio/test_space.py",
    "fileio/test_direct.py", "protocol/test_jsonfile.py", "test_golden.py",
    "test_hostile_input.py", "reader/test_indexing.py", "protocol/test_layout.py",
    "protocol/test_manifest.py", "protocol/test_metadata.py", "protocol/test_v31.py", "test_reader_errors.py",
    "reader/test_manifest_checks.py", "reader/test_verify.py", "reader/test_shards.py", "reader/test_sidecars.py",
    "reader/test_open.py", "test_roundtrip.py", "reader/test_reads.py", "protocol/test_saev_code.py",
    "test_world.py", "convert/test_cache.py", "convert/test_pickle_shards.py", "convert/test_safe_pickle.py",
    "convert/test_pickle_records.py",
]  # fmt: skip

FLOAT8_BYTES = """
import sys
import numpy as np
from saev_shards.codecs import float8

expected = np.load(sys.argv[1])
q, s = float8.quantize_numpy(expected["x"])
assert np.array_equal(q.view(np.uint8), expected["q"]), "quantized bytes differ"
assert np.array_equal(s, expected["s"], equal_nan=True), "scales differ"
for dtype in ("float32", "float16", "bfloat16"):
    ok = np.isfinite(s) & (s * 448 < 65504 if dtype == "float16" else True)  # float16 refuses larger vectors
    got = float8.dequantize(q[ok], s[ok], dtype)
    want = float8.dequantize(expected["q"][ok].view(float8.FLOAT8_DTYPE), expected["s"][ok], dtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), dtype
print("same bytes", len(expected["x"]))
"""


@pytest.mark.slow
def test_the_oldest_versions_the_metadata_allows_write_and_read_caches(wheel: Path, tmp_path: Path) -> None:
    """numpy, orjson, xxhash and ml-dtypes at the lower bounds of the wheel's own metadata: the
    core's unit tests (writing, reading, verifying, golden bytes, float8_e4m3 included) pass,
    and float8 quantizes to the very bytes the pinned ml-dtypes gives."""
    from saev_shards.codecs import float8

    bounds = lower_bounds(wheel)
    assert set(bounds) == {"numpy", "orjson", "xxhash", "ml-dtypes"}, bounds
    oldest = [f"{name}=={version}" for name, version in bounds.items()]
    tools = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith(("pytest==", "hypothesis=="))]
    python = fresh_venv(tmp_path, *oldest, *tools, str(wheel))
    versions = installed(python)
    assert {name: versions[name] for name in bounds} == {
        name: version + ".0" * (2 - version.count(".")) for name, version in bounds.items()
    }, versions
    assert "torch" not in versions and "numba" not in versions  # numpy and ml-dtypes' casts only
    tests = tmp_path / "copy"
    shutil.copytree(REPO / "tests", tests / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tests)  # pytest's configuration (markers)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAEV_", "PYTHON"))}
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         *(f"tests/unit/{name}" for name in CORE_TESTS)],
        cwd=tests, env={**env, "HYPOTHESIS_PROFILE": "ci"}, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "saev_shards" not in os.listdir(tests)
    # float8 bytes against this environment's (constraints.txt's ml-dtypes): values across
    # float32's range, ties, subnormals once scaled, zero and non-finite vectors.
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4096, 64)) * np.exp(rng.uniform(-30, 30, (4096, 1)))).astype(np.float32)
    x[:64] = np.linspace(-448, 448, 64 * 64, dtype=np.float32).reshape(64, 64)
    x[64, 0], x[65] = np.inf, 0.0
    with float8.numpy_only():
        q, s = float8.quantize_numpy(x)
    np.savez(tmp_path / "f8.npz", x=x, q=q.view(np.uint8), s=s)
    assert run(python, FLOAT8_BYTES, str(tmp_path / "f8.npz"), cwd=tmp_path).strip() == "same bytes 4096"
