"""Every cache saev ever wrote opens, reads, verifies and converts (protocol.md 9.5; issue 30).

The fixtures under tests/data/saev-history were written by each version's own code, beside
the arrays they hold; `support.saev_history` writes any other shape the way each version's
writer did (checked first: it reproduces every fixture byte for byte). Every read path must
give exactly the arrays written, in place, without writing a byte into the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import saev_shards as ss
from saev_shards.convert import convert
from saev_shards.errors import ChecksumMismatchError, InvalidCacheError
from saev_shards.protocol import DIALECTS, saev_code

from ..support import saev_history as hist
from ..support.caches import tree_bytes

FIXTURES = hist.fixtures()
IDS = [f"{fmt.folder}/{case.name}" for fmt, _, case in FIXTURES]


def expected_of(case: Path) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8] | None]:
    labels = case / "expected_labels.npy"
    return np.load(case / "expected_acts.npy"), np.load(labels) if labels.exists() else None


def open_quietly(path: Path, **kwargs: Any) -> ss.Shards:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.ProtocolWarning)
        return ss.open(path, **kwargs)


def snapshot(path: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file's bytes, modification time and mode: what reading must leave untouched."""
    out = {}
    for p in sorted(path.rglob("*")):
        st_ = p.lstat()
        out[str(p.relative_to(path))] = (p.read_bytes() if p.is_file() else b"", st_.st_mtime_ns, st_.st_mode)
    return out


def check_reads(shards: ss.Shards, acts: npt.NDArray[np.float32], labels: npt.NDArray[np.uint8] | None) -> None:
    """Every read path of the core library gives exactly ``acts`` and ``labels``."""
    md = shards.metadata
    assert shards.shape == acts.shape and shards.dtype == "float32"
    assert np.array_equal(shards[:], acts)
    n = len(acts)
    for i in range(n):
        assert np.array_equal(shards[i], acts[i])
        for j, layer in enumerate(md.layers):
            assert np.array_equal(shards.example(i, layer), acts[i, j])
            assert np.array_equal(shards.read_example(i, j), acts[i, j])
    if n:
        assert np.array_equal(shards.read_range(0, n), acts)
        rng = np.random.default_rng(0)
        ex, li, tok = rng.integers(0, n, 20), rng.integers(0, md.n_layers, 20), rng.integers(0, md.tokens_per_ex, 20)
        assert np.array_equal(shards.read_vectors(ex, li, tok), acts[ex, li, tok])
        assert np.array_equal(shards.get(n - 1, md.layers[-1], md.tokens_per_ex - 1), acts[n - 1, -1, -1])
        assert np.array_equal(shards[::-2, ..., 1:], acts[::-2, ..., 1:])
    if labels is None:
        assert shards.labels is None
    else:
        assert shards.labels is not None and np.array_equal(np.asarray(shards.labels), labels)


def check_loaders(shards: ss.Shards, acts: npt.NDArray[np.float32], labels: npt.NDArray[np.uint8] | None) -> None:
    """The loaders and datasets (the device path on the CPU too) give exactly ``acts``."""
    pytest.importorskip("torch")
    from saev_shards.loaders import ExampleDataset, LayerPairDataset, OrderedLoader, ShuffledLoader, TokenDataset

    md = shards.metadata
    n_layers, tokens = md.n_layers, md.tokens_per_ex
    stack = n_layers > 1
    want_rows = len(acts) * tokens
    for loader in (
        OrderedLoader(shards, batch_size=5, tokens="all", stack_layers=stack),
        ShuffledLoader(
            shards, batch_size=5, tokens="all", seed=3, buffer_bytes=600, block_bytes=300, stack_layers=stack
        ),
        ShuffledLoader(shards, batch_size=5, tokens="all", seed=3, device="cpu", stack_layers=stack),
    ):
        seen = 0
        for batch in loader:
            got = batch.acts.numpy().reshape(len(batch), -1, md.d_model)
            ex, tok = batch.examples.numpy(), batch.tokens.numpy()
            assert np.array_equal(got, acts[ex, :, tok])
            if labels is not None:
                assert batch.labels is not None
                content = tok >= int(md.cls_token)
                want = labels[ex[content], tok[content] - int(md.cls_token)]
                assert np.array_equal(batch.labels.numpy()[content], want)
            seen += len(batch)
        assert seen == want_rows
        loader.close()
    for j, layer in enumerate(md.layers):
        ds = TokenDataset(shards, layer, tokens="all")
        assert len(ds) == want_rows
        for k in range(0, len(ds), max(1, len(ds) // 7)):
            item = ds[k]
            assert np.array_equal(item["acts"].numpy(), acts[int(item["example"]), j, int(item["token"])])
    if len(acts):
        examples = ExampleDataset(shards, stack_layers=stack, with_labels=labels is not None)
        item = examples[len(acts) - 1]
        assert np.array_equal(item["acts"].numpy().reshape(n_layers, tokens, -1), acts[-1])
        if labels is not None:
            assert np.array_equal(np.asarray(item["labels"]), labels[-1])
    if len(acts) and n_layers > 1:
        pairs = LayerPairDataset(shards)
        for i in range(len(acts)):
            item = pairs[i]
            positions = [md.layer_index(int(v)) for v in item["layers"]]
            assert np.array_equal(item["acts"].numpy(), acts[i, positions])


# --------------------------------------------------------------------------------------
# the fixtures: saev's own caches


@pytest.mark.parametrize(("fmt", "cache", "case"), FIXTURES, ids=IDS)
def test_the_support_writer_is_saevs(fmt: hist.Format, cache: Path, case: Path, tmp_path: Path) -> None:
    """The writer the generated caches below come from reproduces saev's own cache byte for byte."""
    acts, labels = expected_of(case)
    fields = json.loads((cache / "metadata.json").read_bytes())
    assert tuple(fields) == fmt.keys
    built = hist.build(tmp_path, fmt, fields, acts, labels, batch=2)
    assert built.name == cache.name
    assert tree_bytes(built) == tree_bytes(cache)


@pytest.mark.parametrize(("fmt", "cache", "case"), FIXTURES, ids=IDS)
def test_fixture_opens_reads_and_verifies_in_place(fmt: hist.Format, cache: Path, case: Path) -> None:
    acts, labels = expected_of(case)
    before = snapshot(cache)
    with pytest.warns(ss.ProtocolWarning, match=r"read in place by protocol.md section 9.5"):
        shards = ss.open(cache)
    md = shards.metadata
    assert md.dialect == fmt.dialect and md.rules.history and md.hash == cache.name
    assert md.to_bytes() == (cache / "metadata.json").read_bytes()  # the dialect knows every key, in order
    assert md.rules.summary.startswith("saev ") and md.rules.lacks[-1] == "checksums"
    check_reads(shards, acts, labels)
    with pytest.warns(UserWarning, match="records no checksums: the sizes of its .* its name and the zero padding"):
        assert shards.verify() == sum(p.stat().st_size for p in cache.glob("*.bin"))
    shards.close()
    assert snapshot(cache) == before


@pytest.mark.parametrize(("fmt", "cache", "case"), FIXTURES, ids=IDS)
def test_fixture_loaders_and_datasets(fmt: hist.Format, cache: Path, case: Path) -> None:
    acts, labels = expected_of(case)
    with open_quietly(cache) as shards:
        check_loaders(shards, acts, labels)


def test_the_formats_are_told_apart_by_their_keys_alone() -> None:
    """Each fixture is read in its own dialect; the same keys with another hash rule (saev 2.0)
    are told apart by the name, and metadata.json itself decides nothing else."""
    seen = {open_quietly(cache).metadata.dialect for _, cache, _ in FIXTURES}
    assert seen == {fmt.dialect for fmt in hist.FORMATS.values()}
    assert {d.name for d in DIALECTS.values() if d.history} == seen


# --------------------------------------------------------------------------------------
# every other shape, written as each format's writer wrote it


@st.composite
def history_caches(draw: st.DrawFn) -> dict[str, Any]:
    fmt = draw(st.sampled_from(sorted(hist.FORMATS.values(), key=lambda f: f.folder)))
    layers = draw(st.lists(st.integers(-13, 24), min_size=1, max_size=3, unique=True))
    cls_token = draw(st.booleans())
    patches = draw(st.integers(1, 4))
    tokens = patches + int(cls_token)
    per_shard = draw(st.integers(1, 4))
    budget = per_shard * len(layers) * tokens + draw(st.integers(0, len(layers) * tokens - 1))
    exact_fill = draw(st.booleans())
    n = per_shard * draw(st.integers(0, 3)) if exact_fill else draw(st.integers(0, 11))
    with_labels = fmt.labels and n > 0 and draw(st.booleans())
    return {
        "fmt": fmt,
        "fields": hist.fields_for(
            fmt,
            layers=layers,
            patches=patches,
            cls_token=cls_token,
            d=draw(st.integers(1, 7)),
            n=n,
            budget=budget,
            pixel_agg="majority" if with_labels else draw(st.sampled_from([None, "prefer-fg"])),
        ),
        "labels": with_labels,
        "batch": draw(st.integers(1, 5)),
        "truncate": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def build_case(root: Path, case: dict[str, Any]) -> tuple[Path, npt.NDArray[np.float32], Any]:
    fmt, fields = case["fmt"], case["fields"]
    tokens = fields[fmt.patches_key] + int(fields["cls_token"])
    shape = (fields[fmt.count_key], len(fields["layers"]), tokens, fields[fmt.width_key])
    rng = np.random.default_rng(case["seed"])
    acts = (rng.standard_normal(shape) * 3 - 1).astype(np.float32)  # negative values too
    labels = rng.integers(0, 256, (shape[0], fields[fmt.patches_key]), dtype=np.uint8) if case["labels"] else None
    return hist.build(root, fmt, fields, acts, labels, batch=case["batch"]), acts, labels


@settings(max_examples=60)
@given(case=history_caches())
def test_generated_caches_of_every_format_read_exactly(tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]):
    """Several layers with negative values, no CLS token, odd D, labels with and without CLS,
    the all-zero file after an exact fill, the last shard truncated by hand to its data."""
    fmt, fields = case["fmt"], case["fields"]
    folder, acts, labels = build_case(tmp_path_factory.mktemp("hist"), case)
    n = len(acts)
    per_shard = fields[fmt.budget_key] // (acts.shape[1] * acts.shape[2])
    files = sorted(p.name for p in folder.glob("acts*.bin"))
    n_shards = -(-n // per_shard)
    assert len(files) == n_shards + (1 if n % per_shard == 0 else 0)  # saev's writer, as it was
    truncated = case["truncate"] and n % per_shard != 0
    if truncated:
        hist.truncate_last(folder, fields, fmt, acts[0].nbytes)
    shards = open_quietly(folder)
    md = shards.metadata
    assert md.dialect == fmt.dialect and md.n_shards == n_shards and md.hash == folder.name
    assert len(shards.manifest.empty_shards) == (1 if n % per_shard == 0 else 0)
    check_reads(shards, acts, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards.verify()
    shards.close()


@settings(max_examples=8)
@given(case=history_caches())
def test_generated_caches_through_the_loaders(tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]):
    folder, acts, labels = build_case(tmp_path_factory.mktemp("hist"), case)
    with open_quietly(folder) as shards:
        check_loaders(shards, acts, labels)


# --------------------------------------------------------------------------------------
# convert: to protocol 3.1 and to today's saev


@pytest.mark.parametrize(("fmt", "cache", "case"), FIXTURES, ids=IDS)
def test_convert_keeps_values_labels_and_the_old_metadata(
    fmt: hist.Format, cache: Path, case: Path, tmp_path: Path
) -> None:
    acts, labels = expected_of(case)
    before = snapshot(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = convert(cache, root=tmp_path / "ours", durable=False)
        again = convert(cache, root=tmp_path / "ours", durable=False)
        saev = convert(cache, root=tmp_path / "saev" / "shards", to="saev", durable=False)
        via = convert(ours.path, root=tmp_path / "saev" / "shards", to="saev", durable=False)
    assert again.path == ours.path and again.already_published  # the same hash, every time
    md = ours.metadata
    assert md.protocol == "3.1" and md.dtype == "float32"
    assert md.data == {"saev": {"dialect": fmt.dialect, "metadata": json.loads((cache / "metadata.json").read_bytes())}}
    with ss.open(ours.path) as shards:
        shards.verify()
        check_reads(shards, acts, labels)
    # Today's saev: its 13 keys, its name rule, its path, and values it reads.
    assert via.path == saev.path  # from the old cache or from our copy of it, the same cache
    fields = json.loads((saev.path / "metadata.json").read_bytes())
    assert tuple(fields) == saev_code.KEYS and fields["protocol"] == "2.1"
    assert saev.path.name == saev_code.DIALECT.directory_name(saev.metadata) and len(saev.path.name) == 8
    assert saev.path.parts[-3:-1] == ("saev", "shards")
    assert fields["pixel_agg"] in saev_code.PIXEL_AGGS and fields["family"] in saev_code.SAEV_FAMILIES
    assert isinstance(fields["data"], str)
    with open_quietly(saev.path) as shards:
        assert shards.metadata.dialect == "saev"
        shards.verify()
        check_reads(shards, acts, labels)
        per_shard = shards.examples_per_shard
        full = per_shard * acts[0].nbytes
        assert all(p.stat().st_size == full for p in saev.path.glob("acts*.bin"))  # saev memmaps each whole
    assert snapshot(cache) == before


@settings(max_examples=12)
@given(case=history_caches())
def test_convert_of_generated_caches_is_exact_and_repeatable(
    tmp_path_factory: pytest.TempPathFactory, case: dict[str, Any]
) -> None:
    base = tmp_path_factory.mktemp("conv")
    folder, acts, labels = build_case(base / "in", case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = convert(folder, root=base / "out", durable=False)
        second = convert(folder, root=base / "out", durable=False)
    assert first.path == second.path
    with ss.open(first.path) as shards:
        check_reads(shards, acts, labels)


# --------------------------------------------------------------------------------------
# the command line, as a new user runs it on every fixture


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder under /tmp that any user may enter (another user's child runs in it)."""
    folder = Path(tempfile.mkdtemp(prefix="saev-history-", dir="/tmp"))
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o755)
        shutil.rmtree(folder)


def test_cli_reads_every_fixture_in_a_read_only_root(open_folder: Path) -> None:
    """``ls``, ``resolve`` by prefix, ``info``, ``verify``, ``stats`` and ``convert`` over a root
    of saev's caches, read-only (as another user when running as root: modes bind), none of
    whose bytes change."""
    tmp_path = open_folder
    root = tmp_path / "old" / "saev" / "shards"
    root.mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    for _, cache, _ in FIXTURES:
        shutil.copytree(cache, root / cache.name)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o555 if path.is_dir() else 0o444)
    os.chmod(out, 0o777)
    before = {name: snapshot(root / name) for name in os.listdir(root)}
    env = {**os.environ, "SAEV_SHARDS_ROOT": str(root)}
    stage = {key: fixture_of(key).name[:8] for key in ("0.1.0-pypi", "2.0-json")}
    commands = [["ls"]]
    for _, cache, _ in FIXTURES:
        ref = cache.name[:8]
        commands += [["resolve", ref], ["info", ref], ["verify", ref], ["convert", ref, "--root", str(out / "v3")],
                     ["convert", ref, "--to", "saev", "--root", str(out / "saev" / "shards")]]  # fmt: skip
    commands += [["stage", ref, "--to", str(out / "stage")] for ref in stage.values()]
    results = iter(cli_session(commands, env))
    code, listing, err = next(results)
    assert code == 0, err
    assert f"{len(FIXTURES)} caches" in listing and listing.count(" ok") == len(FIXTURES)
    # `ls` names each cache's format (its dialect), as `info` does.
    rows = {line.split()[0]: line.split() for line in listing.splitlines()[2:] if line.strip()}
    for _, cache, _ in FIXTURES:
        assert rows[cache.name[:12]][2] == open_quietly(cache).metadata.dialect
    for _, cache, _ in FIXTURES:
        (code, found, err), (code_info, info, err_info), (code_verify, verify, err_verify) = (
            next(results) for _ in "abc"
        )
        assert code == 0 and found.strip() == str(root / cache.name), err
        assert code_info == 0, err_info
        summary = open_quietly(cache).metadata.rules.summary
        assert f"format     {summary}: one of saev's earlier formats" in info
        assert "lacks" in info and "cannot check the values" in info
        assert code_verify == 0 and verify.startswith("ok "), err_verify
        assert "records no checksums" in err_verify
        for code, _, err in (next(results), next(results)):  # convert, and --to saev
            assert code == 0, err
    # `stage` copies one to local disk, shards.json or none, and the copy reads the same.
    for key in stage:
        code, staged, err = next(results)
        assert code == 0, err
        assert tree_bytes(Path(staged.strip())) == tree_bytes(fixture_of(key))
    assert {name: snapshot(root / name) for name in os.listdir(root)} == before
    # `stats` writes its sidecar beside the caches, in the root's .stats folder, never into a cache.
    os.chmod(root, 0o777)
    first = FIXTURES[0][1].name
    (code, _, err), (_, info, _) = cli_session([["stats", first[:8]], ["info", first[:8]]], env)
    assert code == 0, err
    assert (root / ".stats" / f"{first}.json").is_file()
    assert "per layer, over stored tokens (computed later" in info
    assert {name: snapshot(root / name) for name in os.listdir(root) if name != ".stats"} == before


_SESSION = """
import contextlib, io, json, sys
from saev_shards.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main(argv)
    out.append([code, o.getvalue(), e.getvalue()])
print(json.dumps(out))
"""


def cli_session(commands: list[list[str]], env: dict[str, str]) -> list[tuple[int, str, str]]:
    """``saev-shards`` run on each of ``commands`` in turn in one child process (as another
    user when running as root, so that file modes bind); ``(exit code, stdout, stderr)`` each."""
    prefix: list[str] = []
    if os.geteuid() == 0 and shutil.which("setpriv"):
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", _SESSION, json.dumps(commands)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return [(int(code), str(out), str(err)) for code, out, err in json.loads(proc.stdout)]


# --------------------------------------------------------------------------------------
# bad input stays bad input


def writable(cache: Path, dest: Path) -> Path:
    copy = dest / cache.name
    shutil.copytree(cache, copy)
    for p in [copy, *copy.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return copy


def fixture_of(folder: str, case: str = "1L-cls-partial") -> Path:
    return next(cache for fmt, cache, c in FIXTURES if fmt.folder == folder and c.name == case)


ALL_FORMATS = sorted(hist.FORMATS)


def open_error(path: Path) -> InvalidCacheError:
    with pytest.raises(InvalidCacheError) as caught:
        open_quietly(path)
    return caught.value


@pytest.mark.parametrize("folder", ALL_FORMATS)
def test_a_missing_shard_names_the_file(folder: str, tmp_path: Path) -> None:
    copy = writable(fixture_of(folder), tmp_path)
    (copy / "acts000001.bin").unlink()
    err = open_error(copy)
    assert isinstance(err, ss.CacheNotFoundError) and f"{copy / 'acts000001.bin'}: missing" in str(err)


@pytest.mark.parametrize("folder", ALL_FORMATS)
@pytest.mark.parametrize("size", [1439, 1441, 0])
def test_a_shard_of_another_size_names_the_file(folder: str, size: int, tmp_path: Path) -> None:
    """A short shard, a shard longer than its full size (1,440 bytes): refused, never read."""
    copy = writable(fixture_of(folder), tmp_path)
    os.truncate(copy / "acts000000.bin", size)
    err = open_error(copy)
    assert isinstance(err, ss.FileSizeError)
    assert f"{copy / 'acts000000.bin'}: expected 1440 bytes, found {size}" in str(err)


@pytest.mark.parametrize("folder", ALL_FORMATS)
def test_the_last_shard_of_another_length_than_full_or_its_data(folder: str, tmp_path: Path) -> None:
    """The last shard (1 example of 480 bytes, full 1,440): both lengths read the same; any other is refused."""
    cache = fixture_of(folder)
    acts, _ = expected_of(cache.parents[1])
    copy = writable(cache, tmp_path)
    os.truncate(copy / "acts000002.bin", 480)
    assert np.array_equal(open_quietly(copy)[:], acts)
    for size in (479, 481, 1441):
        os.truncate(copy / "acts000002.bin", size)
        err = open_error(copy)
        assert isinstance(err, ss.FileSizeError) and str(copy / "acts000002.bin") in str(err)


@pytest.mark.parametrize("folder", ALL_FORMATS)
def test_more_examples_than_the_files_hold(folder: str, tmp_path: Path) -> None:
    """``n_imgs`` raised by hand (the name rechecked with check_hash=False): the files do not hold them."""
    fmt = hist.FORMATS[folder]
    copy = writable(fixture_of(folder), tmp_path)
    fields = json.loads((copy / "metadata.json").read_bytes())
    fields[fmt.count_key] = 10
    (copy / "metadata.json").write_bytes(hist.dumps(fmt, fields, 4))
    with pytest.raises(InvalidCacheError) as caught:
        open_quietly(copy, check_hash=False)
    message = str(caught.value)
    if fmt.manifest_count is None:  # the shards follow from metadata.json: the fourth file is missing
        assert f"{copy / 'acts000003.bin'}: missing" in message
    else:
        assert f"{copy / 'shards.json'}: expected 4 shards for n_examples=10" in message
    with pytest.raises(InvalidCacheError, match=r"directory name is not the hash of its metadata\.json"):
        open_quietly(copy)  # and the name says the metadata was changed


@pytest.mark.parametrize("folder", ALL_FORMATS)
def test_an_unlisted_file_and_labels_where_the_format_has_none(folder: str, tmp_path: Path) -> None:
    fmt = hist.FORMATS[folder]
    copy = writable(fixture_of(folder), tmp_path)
    (copy / "acts000005.bin").write_bytes(bytes(1440))
    err = open_error(copy)
    assert isinstance(err, ss.UnexpectedFileError) and str(copy / "acts000005.bin") in str(err)
    (copy / "acts000005.bin").unlink()
    (copy / "labels.bin").write_bytes(bytes(7 * 4))
    if fmt.labels:
        assert open_quietly(copy).labels is not None
    else:
        err = open_error(copy)
        assert isinstance(err, ss.UnexpectedFileError) and "has no labels" in str(err)


@pytest.mark.parametrize("folder", ALL_FORMATS)
def test_padding_that_is_not_zero_fails_verify(folder: str, tmp_path: Path) -> None:
    copy = writable(fixture_of(folder), tmp_path)
    with open(copy / "acts000002.bin", "r+b") as f:
        f.seek(1000)
        f.write(b"\x01")
    shards = open_quietly(copy)
    with pytest.raises(ChecksumMismatchError, match=r"acts000002.bin: byte 1,000 is not zero; bytes 480-1,439 are"):
        shards.verify()


@pytest.mark.parametrize(
    ("folder", "extra", "words"),
    [
        ("0.1.0-pypi", {"model_org": "clip"}, "keys of two formats mixed: 'model_org' is a key of saev before"),
        ("0.1.0-pypi", {"protocol": "1.0.0"}, "keys of two formats mixed"),
        ("1.0.0", {"family": "clip"}, "'family' is a key of protocol 2.1 as saev's code writes it"),
        ("1.1-pixel_agg", {"seed": 1}, "keys of two formats mixed: 'seed' is a key of"),
        ("2.0-json", {"vit_family": "clip"}, "keys of two formats mixed: 'vit_family' is a key of"),
        ("pre0.1-model_org", {"model_family": "clip"}, "two readings possible"),
    ],
)
def test_keys_of_two_formats_mixed_are_refused(folder: str, extra: dict[str, Any], words: str, tmp_path: Path):
    copy = writable(fixture_of(folder), tmp_path)
    fields = {**json.loads((copy / "metadata.json").read_bytes()), **extra}
    (copy / "metadata.json").write_bytes(json.dumps(fields).encode())
    err = open_error(copy)
    assert isinstance(err, ss.MetadataFileError) and f"{copy / 'metadata.json'}: " in str(err)
    assert words in str(err)


def test_saev_20_names_both_hash_rules_when_the_name_is_neither(tmp_path: Path) -> None:
    cache = fixture_of("2.0-json")
    copy = writable(cache, tmp_path)
    renamed = copy.rename(copy.with_name("0" * 64))
    with pytest.raises(ss.HashMismatchError) as caught:
        open_quietly(renamed)
    message = str(caught.value)
    other = hist.name_of(hist.FORMATS["2.0-orjson"], json.loads((renamed / "metadata.json").read_bytes()))
    assert f"expected {cache.name} (sha256 of json.dumps(fields, sort_keys=True, separators=(',', ':'))) or " in message
    assert f"or {other} (sha256 of orjson.dumps(fields, option=OPT_SORT_KEYS)" in message
    # Renamed to its orjson name, the same bytes are a cache of saev's orjson writer.
    assert open_quietly(renamed.rename(renamed.with_name(other))).metadata.dialect == "saev-2.0-orjson"


def test_old_formats_are_never_written(tmp_path: Path) -> None:
    md = open_quietly(fixture_of("0.1.0-pypi")).metadata
    with pytest.raises(ss.MetadataError, match="one of saev's earlier formats, read in place and never written"):
        ss.ShardWriter(tmp_path / "saev" / "shards", md)


def test_convert_of_an_old_cache_killed_then_resumed_is_byte_identical(tmp_path: Path) -> None:
    """SIGKILL mid-conversion (and before publishing), then the same command: the same cache,
    byte for byte, resumed after its sealed shards (saev 1.1 with labels, 9 examples)."""
    from .test_convert_cli import _kill_and_resume

    cache = fixture_of("1.1-pixel_agg", "3L-cls-labels")
    example_nbytes = 3 * 6 * 24 * 4  # 3 layers x (CLS + 5) tokens x 24 dims, float32
    extra = ["--patches-per-shard", str(2 * 3 * 6)]  # 2 examples per shard
    _kill_and_resume(tmp_path, cache, extra, ["0", "7", "publish"], chunk_bytes=example_nbytes, resumes="7")
