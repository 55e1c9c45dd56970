# mypy: disable-error-code="misc"
"""The hostile conversion sources, one catalogue per converter (`CATALOGUE`), and random
damage for the long runs (`random_damage`); `hostile_sources` runs them and checks the rule.

Each case builds a valid source (`sources`), then damages it the way its own adversary
would: a FIFO or a link to /dev/zero where a file should be, a gzip bomb, a 30-byte pickle
asking for gigabytes, a store declaring 10^9 samples in 3 KB, numbers beyond 64 bits,
fractions where integers belong, layer keys that collide, compressed chunks that would
decode past the budget...
"""

from __future__ import annotations

import gzip
import json
import pickle
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .caches import small_metadata, write_cache
from .hostile import NON_REGULAR, mutate, nested, random_value, render, writable
from .sources import npy_source, pickle_source, saelens_source, zarr_source

# --------------------------------------------------------------------------------------
# raw pickles: what a hand-made pickle can ask the unpickler for


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _long(n: int) -> bytes:
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def raw_pickle(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


#: Pickles of a few bytes that ask for gigabytes, or for what the unpickler must never do.
ATTACK_PICKLES: dict[str, bytes] = {
    "bytearray(2**34)": raw_pickle(_global("builtins", "bytearray"), _long(2**34), b"\x85R"),
    "array rebuilt with shape (2**34,)": raw_pickle(
        _global("numpy._core.multiarray", "_reconstruct"), _global("numpy", "ndarray"), _long(2**34), b"\x85",
        b"C\x01b", b"\x87R",
    ),
    "numpy.ndarray((2**34,)) called": raw_pickle(_global("numpy", "ndarray"), _long(2**34), b"\x85\x85R"),
    "memo slot 2**31": raw_pickle(b"N", b"r" + struct.pack("<I", 2**31)),
    "BINBYTES8 declaring 2**40 bytes": b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"abc.",
    "hex codec doubling 40 times": raw_pickle(
        *([_global("_codecs", "encode")] * 40), b"C\x01a", *([b"X\x03\x00\x00\x00hex\x86R"] * 40)
    ),
    "lists 100,000 deep": raw_pickle(b"}X\x07\x00\x00\x00layer_1", b"]" * 100_000, b"a" * 99_999, b"s"),
    "a list holding itself": raw_pickle(b"}X\x07\x00\x00\x00layer_1", b"]q\x00h\x00a", b"s"),
    "os.system": raw_pickle(_global("os", "system"), b"X\x04\x00\x00\x00true\x85R"),
    "truncated": pickle.dumps({"layer_1": [1, 2, 3]})[:-7],
    "not a pickle": b"\x00\x01garbage" * 10,
}  # fmt: skip


def _record(i: int, d: int = 4, seq: int = 3, **changes: Any) -> dict[str, Any]:
    act = np.full((seq, d), i, np.float32)
    rec = {"sample_idx": 1000 + i, "activation": act, "shape": act.shape, "text_preview": f"s{i}",
           "metadata": {"token_count": seq, "score": 0.5}}  # fmt: skip
    rec.update(changes)
    return rec


def _shard(records: list[dict[str, Any]], layers: tuple[str, ...] = ("layer_15", "layer_16")) -> dict[str, Any]:
    return {key: [dict(r) for r in records] for key in layers}


#: Shards made by Python's own pickler, holding what seed 001 must not hold.
ATTACK_SHARDS: dict[str, Callable[[], Any]] = {
    "layer_1 and layer_01": lambda: {"layer_1": [_record(0)], "layer_01": [_record(0)]},
    "fractional sample_idx": lambda: _shard([_record(0, sample_idx=1.5)]),
    "sample_idx 2**70": lambda: _shard([_record(0, sample_idx=2**70)]),
    "sample_idx a string": lambda: _shard([_record(0, sample_idx="7")]),
    "sample_idx an array": lambda: _shard([_record(0, sample_idx=np.arange(3))]),
    "shape a string": lambda: _shard([_record(0, shape="ab")]),
    "shape an integer": lambda: _shard([_record(0, shape=7)]),
    "shape of fractions": lambda: _shard([_record(0, shape=(1.5, 4))]),
    "truncated record (shape says more rows)": lambda: _shard([_record(0, shape=(9, 4))]),
    "activation of integers": lambda: _shard([_record(0, activation=np.zeros((3, 4), np.int32))]),
    "activation of 3 dimensions": lambda: _shard([_record(0, activation=np.zeros((3, 4, 1), np.float32))]),
    "activation a list": lambda: _shard([_record(0, activation=[[1.0] * 4] * 3)]),
    "activation complex": lambda: _shard([_record(0, activation=np.zeros((3, 4), np.complex64))]),
    "records not a list": lambda: {"layer_1": {"a": 1}},
    "record not a dict": lambda: {"layer_1": [7, 8]},
    "shard a list": lambda: [_record(0)],
    "shard empty": lambda: {},
    "layer key of 30 digits": lambda: {"layer_" + "9" * 30: [_record(0)]},
    "layer key of 5,000 digits": lambda: {"layer_" + "9" * 5000: [_record(0)]},  # past int()'s 4,300-digit limit
    "metadata not a dict": lambda: _shard([_record(0, metadata=np.arange(3))]),
    "metadata integer 2**70": lambda: _shard([_record(0, metadata={"token_count": 2**70})]),
    "metadata NaN and infinity": lambda: _shard([_record(3, metadata={"token_count": 3, "score": float("nan")}),
                                                 _record(4, metadata={"token_count": 3, "score": float("inf")})]),
    "metadata fields the first shard lacks": lambda: _shard([_record(3, metadata={"token_count": 3, "score": 1.0,
                                                                                 "new": "x"})]),
    "metadata bool where the first shard has integers": lambda: _shard([_record(3, metadata={"token_count": True,
                                                                                            "score": 1.0})]),
    "metadata string where the first shard has numbers": lambda: _shard([_record(3, metadata={"token_count": "3",
                                                                                             "score": 1.0})]),
    "metadata deep": lambda: _shard([_record(0, metadata={"x": _deep(50)})]),
    "text_preview bytes and arrays": lambda: _shard([_record(3, text_preview=b"\xff\xfe"),
                                                     _record(4, text_preview=np.arange(5))]),
    "different hidden sizes": lambda: _shard([_record(3), _record(4, d=5)]),
    "different sequence lengths across layers": lambda: {"layer_15": [_record(3)], "layer_16": [_record(3, seq=2)]},
    "different sample_idx across layers": lambda: {"layer_15": [_record(3)], "layer_16": [_record(3, sample_idx=7)]},
    "other layers than the first shard": lambda: _shard([_record(3)], ("layer_15", "layer_17")),
    "records counted differently across layers": lambda: {"layer_15": [_record(3), _record(4)],
                                                          "layer_16": [_record(3)]},
    "extra record keys": lambda: _shard([_record(3, extra=1)]),
}  # fmt: skip


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# --------------------------------------------------------------------------------------
# pickle sources


def _index(src: Path) -> dict[str, Any]:
    index: dict[str, Any] = json.loads((src / "metadata.json").read_text())
    return index


def _set_index(src: Path, index: Any, raw: bytes | None = None) -> None:
    (src / "metadata.json").write_bytes(raw if raw is not None else json.dumps(index).encode())


def put_shard(src: Path, k: int, data: bytes, **entry: Any) -> Path:
    """Shard ``k`` (0-based) of a pickle source replaced by ``data``; its index entry loses its
    size and checksum (so the damage reaches the unpickler) and takes ``entry``."""
    index = _index(src)
    e = index["shards"][k]
    e.pop("checksum", None)
    e.pop("size_bytes", None)
    e.update(entry)
    path = src / str(e["filename"])
    path.unlink()
    path.write_bytes(data)
    _set_index(src, index)
    return path


def _options(result: object) -> dict[str, Any]:
    """What a case's builder returned, if it is options for the conversion (else none)."""
    return result if isinstance(result, dict) else {}


def _pickle_base(src: Path) -> None:
    pickle_source(src, per_shard=(3, 2), d_model=4, max_len=3)


def _replace_file(path: Path, kind: str) -> None:
    original = path.read_bytes()
    path.unlink()
    NON_REGULAR[kind](path, original)


def _gzip_bomb(path: Path, members: int = 2_000, member_bytes: int = 1 << 20) -> None:
    """``members`` gzip members of ``member_bytes`` zeros each (2 GB from about 2 MB)."""
    member = gzip.compress(b"\0" * member_bytes, compresslevel=9, mtime=0)
    with open(path, "wb") as f:
        for _ in range(members):
            f.write(member)


PICKLE_CASES: dict[str, Callable[[Path], dict[str, Any]]] = {}


def _pickle_case(name: str) -> Callable[[Callable[[Path], object]], None]:
    def register(fn: Callable[[Path], object]) -> None:
        def build(src: Path) -> dict[str, Any]:
            _pickle_base(src)
            return _options(fn(src))

        PICKLE_CASES[name] = build

    return register


for _kind in ("FIFO", "symlink to /dev/zero", "directory", "symlink loop", "dangling symlink", "socket"):
    _pickle_case(f"a shard that is a {_kind}")(lambda src, k=_kind: _replace_file(src / "shard_0002.pkl.gz", k))
    _pickle_case(f"metadata.json that is a {_kind}")(lambda src, k=_kind: _replace_file(src / "metadata.json", k))


@_pickle_case("gzip bomb (2 MB of members expanding to 2 GB)")
def _(src: Path) -> None:
    put_shard(src, 1, b"")
    _gzip_bomb(src / _index(src)["shards"][1]["filename"])


for _name, _data in ATTACK_PICKLES.items():
    _pickle_case(f"pickle: {_name}")(lambda src, d=_data: put_shard(src, 1, gzip.compress(d, mtime=0)) and None)


def _attack_shard(src: Path, make: Callable[[], Any]) -> None:
    """The first shard made of `_record`s (so later shards are judged against its fields), the second ``make()``."""
    put_shard(src, 0, pickle.dumps(_shard([_record(i) for i in range(3)])), num_samples=3)
    put_shard(src, 1, pickle.dumps(make()))


for _name, _make in ATTACK_SHARDS.items():
    _pickle_case(f"shard: {_name}")(lambda src, m=_make: _attack_shard(src, m))


@_pickle_case("every shard: layer_1 and layer_01")
def _(src: Path) -> None:
    """The same two keys in every shard, so nothing but the collision can stop it (one layer
    silently replaced the other before the fix)."""
    for k, first in ((0, 0), (1, 3)):
        records = [_record(i) for i in range(first, first + (3 if k == 0 else 2))]
        put_shard(src, k, pickle.dumps({"layer_1": records, "layer_01": records}), num_samples=len(records))


@_pickle_case("first shard: metadata integer 2**70 then a later shard's fraction")
def _(src: Path) -> None:
    put_shard(src, 0, pickle.dumps(_shard([_record(i, metadata={"n": 2**70, "k": 3}) for i in range(3)])))
    put_shard(src, 1, pickle.dumps(_shard([_record(3, metadata={"n": 1, "k": 2.5}), _record(4)])))


@_pickle_case("num_samples declaring 10**9 records (--max-tokens: no scan)")
def _(src: Path) -> dict[str, Any]:
    index = _index(src)
    index["shards"][1]["num_samples"] = 10**9
    _set_index(src, index)
    return {"max_tokens": 3}


def _index_case(name: str, change: Callable[[dict[str, Any]], Any]) -> None:
    def build(src: Path) -> None:
        index = _index(src)
        result = change(index)
        _set_index(src, index, result if isinstance(result, bytes) else None)

    _pickle_case(f"index: {name}")(build)


_INDEX_VALUES: dict[str, list[Any]] = {
    "num_samples": [-1, 1.5, 2**70, "3", True],
    "size_bytes": [5, -1, 2**64 - 1],
    "checksum": ["blake9:00", "sha256:xyz", "shake_128:abcd", "sha256:" + "0" * 64, 7, "sha256:" + "a" * 100_000],
    "filename": ["shard\x00.pkl", "..", "/etc/passwd", "x" * 5_000, "shard_0001.pkl.gz", "", 7],
}
for _field, _values in _INDEX_VALUES.items():
    for _value in _values:
        _index_case(
            f"{_field} {render(_value)[:30]}", lambda index, f=_field, v=_value: index["shards"][1].update({f: v})
        )
_index_case("nested 100,000 deep", lambda index: render({"shards": nested(100_000)}).encode())
_index_case("repeated key", lambda index: b'{"shards": [], "shards": ' + json.dumps(index["shards"]).encode() + b"}")
_index_case("an integer of 5,000 digits", lambda index: render({**index, "version": nested(1, "1" * 5000)}).encode())
_index_case("not an object", lambda index: b"[1, 2]")
_index_case("shards not a list", lambda index: index.update({"shards": {"a": 1}}))
_index_case("no shards", lambda index: index.update({"shards": []}))
_index_case("not UTF-8", lambda index: b'{"shards": "\xff\xfe"}')
_index_case("invalid JSON", lambda index: b'{"shards": [NaN]}')


# --------------------------------------------------------------------------------------
# zarr sources


def _zarr_base(src: Path) -> Path:
    zarr_source(src, n=5, p_max=4, r_max=2, d_model=4)
    return src / "activations.zarr"


def _zarray(store: Path, name: str) -> Path:
    return store / "arrays" / name / ".zarray"


def _edit_json(path: Path, change: Callable[[Any], Any]) -> None:
    doc = json.loads(path.read_text())
    result = change(doc)
    path.write_bytes(result if isinstance(result, bytes) else json.dumps(doc).encode())
    consolidated = path.parents[2] / ".zmetadata" if path.parent.parent.name == "arrays" else None
    if consolidated is not None and consolidated.exists():
        consolidated.unlink()  # the store is read from its own .zarray files


ZARR_CASES: dict[str, Callable[[Path], dict[str, Any]]] = {}


def _zarr_case(name: str) -> Callable[[Callable[[Path], object]], None]:
    def register(fn: Callable[[Path], object]) -> None:
        def build(src: Path) -> dict[str, Any]:
            store = _zarr_base(src)
            if (store / ".zmetadata").exists():
                (store / ".zmetadata").unlink()  # damage reaches zarr through the files it reads
            return _options(fn(store))

        ZARR_CASES[name] = build

    return register


for _kind in ("FIFO", "symlink to /dev/zero", "directory", "symlink loop", "dangling symlink"):
    _zarr_case(f"text file that is a {_kind}")(
        lambda store, k=_kind: _replace_file(store / "text" / "prompts.jsonl", k)
    )
    _zarr_case(f"a chunk file that is a {_kind}")(
        lambda store, k=_kind: _replace_file(store / "arrays" / "prompt_activations" / "0.0.0.0", k)
    )
    _zarr_case(f"meta/config.json that is a {_kind}")(
        lambda store, k=_kind: _replace_file(store / "meta" / "config.json", k)
    )


@_zarr_case("declares 10**9 samples in a few KB")
def _(store: Path) -> None:
    for name in ("prompt_activations", "response_activations", "prompt_len", "response_len", "hallu_label", "split",
                 "sample_key"):  # fmt: skip
        _edit_json(_zarray(store, name), lambda doc: doc.update({"shape": [10**9, *doc["shape"][1:]]}))


def _compressed_chunk(store: Path, compressor: dict[str, Any], chunk: bytes) -> None:
    """prompt_activations declared compressed with ``compressor``, its first chunk ``chunk``."""
    _edit_json(_zarray(store, "prompt_activations"), lambda doc: doc.update({"compressor": compressor}))
    (store / "arrays" / "prompt_activations" / "0.0.0.0").write_bytes(chunk)


@_zarr_case("a gzip bomb in a chunk")
def _(store: Path) -> None:
    member = gzip.compress(b"\0" * (1 << 20), compresslevel=9, mtime=0)
    _compressed_chunk(store, {"id": "gzip", "level": 1}, member * 1000)


@_zarr_case("a Zstandard chunk declaring 2**40 bytes")
def _(store: Path) -> None:
    header = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (2**40).to_bytes(8, "little")
    _compressed_chunk(store, {"id": "zstd", "level": 0}, header + b"\0" * 64)


@_zarr_case("a Zstandard chunk declaring no size")
def _(store: Path) -> None:
    header = b"\x28\xb5\x2f\xfd" + bytes([0x00, 0x50])
    _compressed_chunk(store, {"id": "zstd", "level": 0}, header + b"\0" * 64)


@_zarr_case("a Blosc chunk declaring 2**31 bytes")
def _(store: Path) -> None:
    header = (
        bytes([2, 1, 1, 2])
        + (2**31 - 1).to_bytes(4, "little")
        + (1 << 16).to_bytes(4, "little")
        + (64).to_bytes(4, "little")
    )
    _compressed_chunk(
        store, {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}, header + b"\0" * 48
    )


@_zarr_case("a bz2 compressor")
def _(store: Path) -> None:
    import bz2

    _compressed_chunk(store, {"id": "bz2", "level": 9}, bz2.compress(b"\0" * (1 << 24)))


@_zarr_case("garbage chunk bytes")
def _(store: Path) -> None:
    (store / "arrays" / "prompt_activations" / "0.0.0.0").write_bytes(b"\x01\x02garbage")


@_zarr_case("chunks of 10**12 samples")
def _(store: Path) -> None:
    _edit_json(_zarray(store, "prompt_activations"), lambda doc: doc.update({"chunks": [10**12, 1, 2, 4]}))


for _field, _value in {
    "dtype <i4": ("dtype", "<i4"),
    "dtype garbage": ("dtype", "<q17"),
    "shape negative": ("shape", [-5, 2, 4, 4]),
    "shape of 3 axes": ("shape", [5, 2, 4]),
    "shape 2**70": ("shape", [2**70, 2, 4, 4]),
    "chunks zero": ("chunks", [0, 1, 2, 4]),
    "compressor unknown": ("compressor", {"id": "no-such-codec"}),
    "fill_value a string": ("fill_value", "abc"),
}.items():
    _zarr_case(f"prompt_activations .zarray: {_field}")(
        lambda store, f=_value: _edit_json(_zarray(store, "prompt_activations"), lambda doc: doc.update({f[0]: f[1]}))
    )
_zarr_case(".zarray nested 100,000 deep")(
    lambda store: _zarray(store, "prompt_activations").write_text(render(nested(100_000)))
)
_zarr_case(".zattrs layers beyond 64 bits")(
    lambda store: (store / ".zattrs").write_text(json.dumps({"layers": [2**70, 1]}))
)
_zarr_case("prompt_len of floats")(
    lambda store: _edit_json(_zarray(store, "prompt_len"), lambda doc: doc.update({"dtype": "<f4"}))
)
_zarr_case("prompt_len of another length")(
    lambda store: _edit_json(_zarray(store, "prompt_len"), lambda doc: doc.update({"shape": [3], "chunks": [3]}))
)


def _jsonl(store: Path, lines: list[bytes]) -> None:
    (store / "text" / "prompts.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))


for _name, _lines in {
    "a fractional 'i'": [b'{"i": 0.5}', b'{"i": 1}'],
    "'i' on some lines only": [b'{"i": 0}', b'{"x": 1}'],
    "'i' a bool": [b'{"i": true}'],
    "'i' beyond 64 bits": [b'{"i": ' + b"9" * 30 + b"}"],
    "a line of 20 MB": [b'"' + b"x" * (20 << 20) + b'"'],
    "a line that is not JSON": [b"{not json"],
    "a NaN": [b'{"i": 0, "x": NaN}'],
    "nesting 100,000 deep": [b"[" * 100_000 + b"]" * 100_000],
    "more lines than samples": [b'"x"'] * 9,
    "a repeated key": [b'{"i": 0, "i": 1}'],
}.items():
    _zarr_case(f"text file: {_name}")(lambda store, ls=_lines: _jsonl(store, ls))


# --------------------------------------------------------------------------------------
# SAELens sources


def _saelens_base(src: Path) -> None:
    saelens_source(src, n=6, context_size=3, d_in=4, num_shards=1)


SAELENS_CASES: dict[str, Callable[[Path], dict[str, Any]]] = {}


def _saelens_case(name: str) -> Callable[[Callable[[Path], object]], None]:
    def register(fn: Callable[[Path], object]) -> None:
        def build(src: Path) -> dict[str, Any]:
            _saelens_base(src)
            return _options(fn(src))

        SAELENS_CASES[name] = build

    return register


def _arrow(src: Path) -> Path:
    return next(src.glob("*.arrow"))


for _kind in ("FIFO", "symlink to /dev/zero", "dangling symlink"):
    _saelens_case(f"arrow file that is a {_kind}")(lambda src, k=_kind: _replace_file(_arrow(src), k))
    _saelens_case(f"state.json that is a {_kind}")(lambda src, k=_kind: _replace_file(src / "state.json", k))
_saelens_case("arrow file truncated")(lambda src: _arrow(src).write_bytes(_arrow(src).read_bytes()[:300]))
_saelens_case("arrow file garbage")(lambda src: _arrow(src).write_bytes(b"ARROW1\x00\x00" + b"\xff" * 500))


def _features(src: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    path = src / "dataset_info.json"
    info = json.loads(path.read_text())
    result = change(info["features"])
    path.write_bytes(result if isinstance(result, bytes) else json.dumps(info).encode())


for _name, _value in {
    "shape of strings": ["a", 4],
    "shape 2**70": [2**70, 4],
    "shape declaring 10**6 x 10**6": [10**6, 10**6],
    "shape of 1 axis": [3],
    "shape negative": [-3, 4],
}.items():
    _saelens_case(f"hook {_name}")(
        lambda src, v=_value: _features(src, lambda f: f["blocks.3.hook_resid_post"].update({"shape": v}))
    )
_saelens_case("hook dtype int32")(
    lambda src: _features(src, lambda f: f["blocks.3.hook_resid_post"].update({"dtype": "int32"}))
)
_saelens_case("hook dtype garbage")(
    lambda src: _features(src, lambda f: f["blocks.3.hook_resid_post"].update({"dtype": "q17"}))
)
_saelens_case("a hook the tables do not have")(
    lambda src: _features(src, lambda f: f.update({"blocks.9.hook_x": dict(f["blocks.3.hook_resid_post"])}))
)
_saelens_case("dataset_info.json nested 100,000 deep")(
    lambda src: (src / "dataset_info.json").write_text(render({"features": nested(100_000)}))
)
_saelens_case("token_ids of length 2**40")(
    lambda src: _features(src, lambda f: f["token_ids"].update({"length": 2**40}))
)


# --------------------------------------------------------------------------------------
# .npy sources


def _npy_header(shape: str, descr: str = "<f4", order: str = "False") -> bytes:
    header = f"{{'descr': '{descr}', 'fortran_order': {order}, 'shape': {shape}, }}".encode()
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


def _npy_base(src: Path) -> None:
    src.mkdir()
    npy_source(src / "acts.npy", shape=(5, 2, 3, 4))


NPY_CASES: dict[str, Callable[[Path], dict[str, Any]]] = {}


def _npy_case(name: str) -> Callable[[Callable[[Path], object]], None]:
    def register(fn: Callable[[Path], object]) -> None:
        def build(src: Path) -> dict[str, Any]:
            _npy_base(src)
            return _options(fn(src / "acts.npy"))

        NPY_CASES[name] = build

    return register


for _kind in ("FIFO", "symlink to /dev/zero", "symlink loop"):
    _npy_case(f"a {_kind}")(lambda path, k=_kind: _replace_file(path, k))
for _name, _bytes in {
    "shape declaring 10**12 examples": _npy_header("(1000000000000, 2, 3, 4)") + b"\0" * 64,
    "shape beyond 64 bits": _npy_header("(" + "9" * 30 + ", 2, 3, 4)"),
    "shape of fractions": _npy_header("(1.5, 2, 3, 4)"),
    "object dtype": _npy_header("(5, 2, 3, 4)", "|O"),
    "integers": _npy_header("(5, 2, 3, 4)", "<i4") + b"\0" * 480,
    "three axes": _npy_header("(5, 3, 4)") + b"\0" * 240,
    "truncated data": _npy_header("(5, 2, 3, 4)") + b"\0" * 100,
    "header garbage": b"\x93NUMPY\x01\x00\x10\x00{'descr': ((((\n",
    "header length beyond the file": b"\x93NUMPY\x01\x00\xff\xff{",
    "an expression in the header": _npy_header("__import__('os').system('true')"),
    "zero tokens": _npy_header("(5, 2, 0, 4)"),
}.items():
    _npy_case(_name)(lambda path, b=_bytes: path.write_bytes(b) and None)


# --------------------------------------------------------------------------------------
# cache sources (`--from cache`, `--to saev` and back): a cache of this library, damaged


def _cache_base(src: Path) -> None:
    """A 3.1 cache with labels, text and statistics at ``src/<hash>``, its modes undone (so a
    case can damage it as a non-root user too)."""
    md = small_metadata()
    write_cache(src, md, labels=True, text=True, stats=True)
    writable(src / md.hash)


def _the_cache(src: Path) -> Path:
    return next(p for p in src.iterdir() if p.is_dir())


def _flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


CACHE_CASES: dict[str, Callable[[Path], dict[str, Any]]] = {}


def _cache_case(name: str) -> Callable[[Callable[[Path], object]], None]:
    def register(fn: Callable[[Path], object]) -> None:
        def build(src: Path) -> dict[str, Any]:
            _cache_base(src)
            return _options(fn(_the_cache(src)))

        CACHE_CASES[name] = build

    return register


for _kind in ("FIFO", "symlink to /dev/zero", "dangling symlink", "directory"):
    _cache_case(f"a shard that is a {_kind}")(lambda cache, k=_kind: _replace_file(cache / "acts000001.bin", k))
    _cache_case(f"metadata.json that is a {_kind}")(lambda cache, k=_kind: _replace_file(cache / "metadata.json", k))
_cache_case("a flipped bit in a shard")(lambda cache: _flip(cache / "acts000002.bin"))
_cache_case("a flipped bit in labels.bin")(lambda cache: _flip(cache / "labels.bin", 3))
_cache_case("a flipped bit in the text file")(lambda cache: _flip(cache / "text.prompt.jsonl", 5))
_cache_case("shards.json cut short")(
    lambda cache: (cache / "shards.json").write_bytes((cache / "shards.json").read_bytes()[:40])
)
_cache_case("a missing shard")(lambda cache: (cache / "acts000001.bin").unlink())
_cache_case("an extra data file")(lambda cache: (cache / "acts000099.bin").write_bytes(b"\0" * 64))
_cache_case("a shard one byte longer")(
    lambda cache: (cache / "acts000000.bin").write_bytes((cache / "acts000000.bin").read_bytes() + b"\0")
)


# --------------------------------------------------------------------------------------
# the catalogue, and random damage for the long runs

#: The only cases that may convert: damage that the mapping documents (values kept as they
#: are, or a line in the "not carried over" report). Every other case must be refused.
MAY_CONVERT = frozenset(
    [
        "pickle: shard: metadata NaN and infinity",  # a float column holds them
        "pickle: shard: text_preview bytes and arrays",  # text as JSON values
        "pickle: shard: metadata fields the first shard lacks",  # counted in the report
        "pickle: shard: extra record keys",  # counted in the report
    ]
)

CATALOGUE: dict[str, tuple[str, dict[str, Callable[[Path], dict[str, Any]]]]] = {
    "pickle": ("pickle", PICKLE_CASES),
    "zarr": ("zarr", ZARR_CASES),
    "saelens": ("saelens", SAELENS_CASES),
    "npy": ("npy", NPY_CASES),
    "cache": ("cache", CACHE_CASES),
}
BASES: dict[str, Callable[[Path], Any]] = {
    "pickle": _pickle_base,
    "zarr": _zarr_base,
    "saelens": _saelens_base,
    "npy": _npy_base,
    "cache": _cache_base,
}


def source_path(kind: str, src: Path) -> Path:
    if kind == "cache":
        return _the_cache(src)
    return src / "acts.npy" if kind == "npy" else src


def random_damage(src: Path, rng: random.Random) -> str:
    """One random damage to a valid source: a JSON file mutated by the cache fuzzer's engine, a
    data file's bytes flipped, cut or grown, or a file replaced by something not regular."""
    candidates = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink())
    path = rng.choice(candidates)
    name = str(path.relative_to(src))
    roll = rng.random()
    if roll < 0.1:
        kind = rng.choice(["FIFO", "symlink to /dev/zero", "directory", "dangling symlink"])
        _replace_file(path, kind)
        return f"{name}: replaced by a {kind}"
    data = path.read_bytes()
    if path.suffix in (".json", ".jsonl", ".zarray", ".zattrs", ".zgroup", ".zmetadata") and roll < 0.7:
        try:
            doc = json.loads(data.splitlines()[0] if path.suffix == ".jsonl" else data)
        except ValueError:
            doc = None
        if isinstance(doc, dict):  # the engine's key mutations work on objects
            from .hostile import MUTATIONS

            kind = rng.choice(MUTATIONS)
            value = random_value(rng)
            path.write_bytes(mutate(doc, kind, rng.randrange(1 << 30), value, rng))
            return f"{name}: {kind} with {render(value)[:40]!r}"
    blob = bytearray(data)
    action = rng.choice(["flip", "truncate", "grow", "zero"])
    if action == "flip" and blob:
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(blob))
            blob[i] ^= 1 << rng.randrange(8)
    elif action == "truncate":
        del blob[rng.randrange(len(blob) + 1) :]
    elif action == "grow":
        blob += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    else:
        start = rng.randrange(len(blob) + 1)
        blob[start : start + rng.randrange(1, 256)] = b"\0" * len(blob[start : start + 255])
    path.write_bytes(bytes(blob))
    return f"{name}: {action}"


def copy_source(base: Path, dest: Path) -> None:
    shutil.copytree(base, dest, symlinks=True)
