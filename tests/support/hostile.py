"""Hostile and damaged caches: a JSON renderer that can write what ``json.dumps`` cannot
(repeated keys, raw tokens), a mutation engine over the JSON files of a cache, the catalogue
of non-regular files, and the rule every reader must follow, checked under a time bound.

Used by the hostile-input and corruption suites (unit) and the command-line sample
(integration); the hypothesis strategies over the same catalogue live in ``strategies.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import saev_shards as ss
from saev_shards.protocol.v3 import content_hash

from .caches import small_metadata, write_cache

# --------------------------------------------------------------------------------------
# a time bound that a blocking system call cannot escape


class Hang(BaseException):
    """Raised by `time_bound` (a BaseException: no library ``except`` clause may swallow it)."""


@contextlib.contextmanager
def time_bound(seconds: float, what: str) -> Iterator[None]:
    """Raise `Hang` if the body runs longer than ``seconds``. SIGALRM interrupts blocking
    system calls (``open`` of a FIFO, ``read`` of a pipe), so a hang becomes a failure."""

    def fire(signum: int, frame: object) -> None:
        raise Hang(f"{what}: still running after {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


#: Per case: far above the few milliseconds a small cache takes, far below "forever".
CASE_SECONDS = 20.0

# --------------------------------------------------------------------------------------
# the rule


def open_and_use(path: Path, check_hash: bool = True) -> str:
    """Apply the rule to the cache at ``path``: `open`, and when it succeeds everything that
    reads JSON or data (repr, stats, text, verify), either succeeds or raises a ShardsError.

    Returns the outcome (``"ok"`` or the error's class name); any other exception, or a
    hang, propagates with the case named.
    """
    outcome = "ok"
    with time_bound(CASE_SECONDS, f"open {path}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            shards = ss.open(path, check_hash=check_hash)
        except ss.ShardsError as err:
            return type(err).__name__
        try:
            repr(shards)
            _ = shards.stats
            for name in shards.manifest.text:
                list(shards.text(name))
            for name, _, _ in shards.manifest.blocked_files():
                shards.block_digests(name)
            if shards.n_examples:
                shards[0]  # dequantized with its scales in a float8_e4m3 cache
            shards.verify()
        except ss.ShardsError as err:
            outcome = "opened, then " + type(err).__name__
        finally:
            shards.close()
    return outcome


# --------------------------------------------------------------------------------------
# pristine caches to damage


@dataclasses.dataclass(frozen=True)
class Pristine:
    """A small valid cache, writable: its JSON files, and its data files (stats.json is both)."""

    path: Path
    protocol: str
    json_files: tuple[str, ...]
    data_files: tuple[str, ...]


def make_pristine(base: Path) -> list[Pristine]:
    """Caches with every kind of file (labels, a lengths column, text, stats), written under
    ``base`` and made writable: protocol 3.1 in float16 (blocks.json), a 2.1 cache with labels
    and checksums.json, 3.1 in float8_e4m3 (scale files too), and 3.0 in float16."""
    base.mkdir(parents=True, exist_ok=True)
    md3 = small_metadata()
    lengths = (1 + np.arange(md3.n_examples) % md3.tokens_per_ex).astype("int32")
    write_cache(base, md3, labels=True, text=True, lengths=lengths, stats=True)
    md2 = small_metadata(dtype="float32", protocol="2.1", n_examples=9, data="gASVAAAA")
    write_cache(base, md2, labels=True)
    md8 = small_metadata(dtype="float8_e4m3")
    write_cache(base, md8, labels=True, text=True, lengths=lengths, stats=True)
    md30 = small_metadata(protocol="3.0")
    write_cache(base, md30, labels=True, text=True, lengths=lengths, stats=True)
    out = []
    for md in (md3, md2, md8, md30):
        path = base / md.hash
        writable(path)
        names = sorted(p.name for p in path.iterdir())
        out.append(
            Pristine(
                path,
                md.protocol,
                tuple(n for n in names if n.endswith(".json")),
                tuple(n for n in names if not n.endswith(".json") or n in ("stats.json", "blocks.json")),
            )
        )
    return out


def writable(path: Path) -> Path:
    """Undo a published cache's read-only modes so a test can damage it."""
    os.chmod(path, 0o755)
    for p in path.iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o644)
    return path


def edit_json(path: Path, fn: Callable[[Any], Any]) -> None:
    """Rewrite the JSON file ``path`` as ``fn`` changes its value."""
    obj = json.loads(path.read_text())
    path.write_text(json.dumps(fn(obj)))


@contextlib.contextmanager
def intact_afterwards(path: Path) -> Iterator[None]:
    """Whatever the body does to the cache at ``path``, it is as it was afterwards."""
    names = [p.name for p in path.iterdir()]
    with restored(path, names):
        yield
    for p in path.iterdir():
        if p.name not in names:
            remove_any(p)
    cleanup_extras(path)


@contextlib.contextmanager
def restored(path: Path, names: Sequence[str]) -> Iterator[None]:
    """Put the files ``names`` of ``path`` back as they were after the body (whatever replaced them)."""
    saved = {n: (path / n).read_bytes() for n in names}
    try:
        yield
    finally:
        for n, data in saved.items():
            p = path / n
            remove_any(p)
            p.write_bytes(data)


def remove_any(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()


# --------------------------------------------------------------------------------------
# rendering JSON that json.dumps cannot write


@dataclasses.dataclass(frozen=True)
class Raw:
    """JSON text written as is: ``NaN``, a 5000-digit integer, an escape of a lone surrogate."""

    text: str


@dataclasses.dataclass(frozen=True)
class Pairs:
    """An object written from its pairs, so a key may repeat."""

    pairs: tuple[tuple[str, Any], ...]


def render(value: Any) -> str:
    """JSON text of ``value`` (dicts, lists, `Raw`, `Pairs` and JSON scalars)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ", ".join(f"{json.dumps(k)}: {render(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, dict):
        return render(Pairs(tuple(value.items())))
    if isinstance(value, list):
        return "[" + ", ".join(render(v) for v in value) + "]"
    return json.dumps(value)


def nested(depth: int, inner: str = "1", brackets: str = "[]") -> Raw:
    """``depth`` levels of arrays (or objects with ``brackets='{}'``) around ``inner``."""
    if brackets == "{}":
        return Raw('{"k": ' * depth + inner + "}" * depth)
    return Raw("[" * depth + inner + "]" * depth)


#: Values every hostile run draws from: the cases the fuzzer of issue 10 found, and their kin.
HOSTILE_VALUES: tuple[Any, ...] = (
    # integers at and beyond 64 bits; integers of more digits than Python converts
    2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, Raw("1" + "0" * 5000), -1, 0, 1,
    # numbers that are not finite, or round to 0 or infinity
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("1e-400"), 1e308, -0.0, 2.5,
    1e19, Raw("1.0"), Raw("1E2"), True, False, None,
    # names: NUL, paths out of the cache, devices, other shards, control characters, surrogates
    "", "\x00", "acts000000.bin\x00", "..", "../../etc/passwd", "/etc/passwd", "/dev/zero", "acts000000.bin",
    "acts000099.bin", "acts00000.bin", "labels.bin", "stats.json", "metadata.json", ".", "./acts000000.bin",
    Raw('"\\ud800"'), Raw('"\\udc00\\ud800"'), Raw('"a\\u0000b"'), "\x1b[2J\x1b]0;pwned\x07", "\u202eevil", "é",
    "x" * 100_000, "hf-hub:timm/x", '{"a": 1}', "[[[[", "\\",
    # containers: empty, wide, deep (at, just past and far past the depth limit), repeated keys
    [], {}, list(range(10_000)), {f"k{i}": i for i in range(2_000)}, nested(62), nested(63), nested(64),
    nested(65), nested(300), nested(2_000), nested(70_000), nested(63, brackets="{}"), nested(300, brackets="{}"),
    Pairs((("a", 1), ("a", 2))), Pairs((("name", "acts000000.bin"), ("name", "x"))), [nested(40), nested(40)],
)  # fmt: skip


# --------------------------------------------------------------------------------------
# the mutation engine


def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a node of the parsed document (the root is ``()``)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths_of(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(doc)
    copy: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replace(doc[path[0]], path[1:], fn)
    return copy


MUTATIONS = (
    "replace", "replace", "replace", "delete", "insert key", "repeat key", "rename key", "wrap deep",
    "flip byte", "truncate", "insert bytes", "delete bytes", "duplicate entry", "generate",
)  # fmt: skip


def mutate(doc: Any, kind: str, where: int, value: Any, rng: random.Random) -> bytes:
    """The bytes of ``doc`` (a parsed JSON file) damaged once: ``kind`` from `MUTATIONS`,
    at node number ``where`` (modulo the node count), with ``value`` where one is needed."""
    paths = paths_of(doc)
    path = paths[where % len(paths)]
    if kind == "replace":
        return render(_replace(doc, path, lambda _: value)).encode("utf-8", "surrogatepass")
    if kind == "delete" and path:
        parent, key = path[:-1], path[-1]

        def drop(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: v for k, v in node.items() if k != key}
            return node[:key] + node[key + 1 :]

        return render(_replace(doc, parent, drop)).encode()
    objects = [p for p in paths if isinstance(_get(doc, p), dict)] or [()]
    target = objects[where % len(objects)]
    if kind == "insert key":
        key = rng.choice(["extra", "", "\x00", "name", "shards", "../x", "k" * 1000])
        return render(_replace(doc, target, lambda node: Pairs((*_items(node), (key, value))))).encode()
    if kind == "repeat key":

        def repeat(node: Any) -> Any:
            items = _items(node)
            if not items:
                return Pairs((("a", 1), ("a", 1)))
            k, v = items[where % len(items)]
            return Pairs((*items, (k, value if rng.random() < 0.5 else v)))

        return render(_replace(doc, target, repeat)).encode()
    if kind == "rename key":

        def rename(node: Any) -> Any:
            items = _items(node)
            if not items:
                return node
            i = where % len(items)
            new = rng.choice([items[i][0].upper(), items[i][0] + " ", "\x00", items[(i + 1) % len(items)][0]])
            return Pairs(tuple((new if j == i else k, v) for j, (k, v) in enumerate(items)))

        return render(_replace(doc, target, rename)).encode()
    if kind == "wrap deep":
        depth = rng.choice([60, 64, 65, 200, 1_100, 50_000])
        return render(_replace(doc, path, lambda node: Raw("[" * depth + render(node) + "]" * depth))).encode()
    if kind == "duplicate entry":
        lists = [p for p in paths if isinstance(_get(doc, p), list) and _get(doc, p)] or [path]
        at = lists[where % len(lists)]
        return render(_replace(doc, at, lambda node: node + node[:1] if isinstance(node, list) else node)).encode()
    if kind == "generate":
        return render(value).encode("utf-8", "surrogatepass")
    data = bytearray(render(doc).encode())
    pos = where % max(1, len(data))
    if kind == "flip byte" and data:
        data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert bytes":
        data[pos:pos] = rng.choice([b"\x00", b"\xff\xfe", b"\xef\xbb\xbf", b"NaN", b",", b"}", b"\xed\xa0\x80", b":"])
    elif kind == "delete bytes":
        del data[pos : pos + rng.randrange(1, 8)]
    return bytes(data)


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _items(node: Any) -> tuple[tuple[str, Any], ...]:
    return node.pairs if isinstance(node, Pairs) else tuple(node.items())


def random_value(rng: random.Random) -> Any:
    """A hostile value: one of `HOSTILE_VALUES`, or a small structure built from them."""
    if rng.random() < 0.7:
        return rng.choice(HOSTILE_VALUES)
    if rng.random() < 0.5:
        return [rng.choice(HOSTILE_VALUES) for _ in range(rng.randrange(4))]
    return {rng.choice(["name", "nbytes", "n_examples", "xxh3_128", "x"]): rng.choice(HOSTILE_VALUES)}


def generated_manifest(pristine: Any, rng: random.Random) -> Any:
    """A shards.json built from scratch around a pristine one: entries added, dropped,
    renamed and renumbered, hostile values in random fields (both protocol layouts)."""
    legacy = isinstance(pristine, list)
    entries = [dict(e) for e in (pristine if legacy else pristine["shards"])]
    for _ in range(rng.randrange(1, 4)):
        action = rng.randrange(4)
        if action == 0 and entries:
            entries.pop(rng.randrange(len(entries)))
        elif action == 1:
            entries.append(dict(rng.choice(entries)) if entries else {"name": "acts000000.bin", "n_examples": 0})
        elif action == 2 and entries:
            e = rng.choice(entries)
            e[rng.choice(sorted(e))] = random_value(rng)
        elif entries:
            e = rng.choice(entries)
            e["name"] = rng.choice([f"acts{rng.randrange(0, 12):06d}.bin", "acts999999.bin", "/etc/passwd", "\x00"])
    if legacy:
        return entries
    out = dict(pristine)
    out["shards"] = entries
    field = rng.choice([f for f in ("labels", "columns", "text", "stats", "scales", "blocks") if f in out] + [None])
    if field is not None:
        out[field] = rng.choice([None, {}, random_value(rng), {"x": random_value(rng)}, out[field]])
    if isinstance(out.get("scales"), list) and out["scales"] and rng.random() < 0.5:  # float8_e4m3: its scale files
        scales = [dict(e) for e in out["scales"]]
        e = rng.choice(scales)
        e[rng.choice(sorted(e))] = rng.choice([random_value(rng), "scales000099.bin", "acts000000.bin", -1, 2**63])
        out["scales"] = rng.choice([scales, scales[:-1], [*scales, scales[0]]])
    return out


def random_case(
    rng: random.Random, docs: dict[str, Any], sizes: dict[str, int] | None = None
) -> tuple[str, bytes, str]:
    """``(file name, new bytes, description)`` of one random damage to one of ``docs`` (parsed
    JSON files; ``sizes``: their sizes on disk, to pad stats.json back to when shorter)."""
    name = rng.choice(sorted(docs))
    kind = rng.choice(MUTATIONS)
    where = rng.randrange(1 << 30)
    if kind == "generate":
        doc = generated_manifest(docs[name], rng) if name == "shards.json" else random_value(rng)
        return name, render(doc).encode("utf-8", "surrogatepass"), f"{name}: generated"
    value = random_value(rng)
    label = value.text[:40] if isinstance(value, Raw) else repr(value)[:40]
    data = mutate(docs[name], kind, where, value, rng)
    if name == "stats.json" and sizes:  # keep its listed size when possible, so the parser is reached
        data += b" " * (sizes[name] - len(data))
    return name, data, f"{name}: {kind} at node {where} with {label}"


def hashed_copy(src: Path, dest_root: Path, metadata: Any) -> Path:
    """A writable copy of the cache ``src`` whose metadata.json is ``metadata`` (rendered, so
    `Raw` and `Pairs` work), in a folder named by the hash of what Python's json parses from it."""
    text = render(metadata)
    dest = dest_root / content_hash(json.loads(text))
    shutil.copytree(src, dest)
    writable(dest)
    (dest / "metadata.json").write_text(text)
    return dest


# --------------------------------------------------------------------------------------
# files that are not regular files


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _socket(p: Path) -> None:
    # A socket's path must fit 108 bytes: bind in a short folder, then rename it into place.
    short = Path(tempfile.mkdtemp(dir=p.parent.parent, prefix="s"))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.relpath(short / "s"))
        os.rename(short / "s", p)
    finally:
        shutil.rmtree(short)


def _char_device(p: Path) -> None:
    os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # the device /dev/zero is


def _outside_copy(p: Path, original: bytes) -> None:
    outside = p.parent.parent / f"outside-{p.name}"
    outside.write_bytes(original)
    p.symlink_to(outside)


def _inside_copy(p: Path, original: bytes) -> None:
    (p.parent / f"copy-of-{p.name}").write_bytes(original)
    p.symlink_to(f"copy-of-{p.name}")


#: name -> how to put such a thing at a path (given the file's original bytes).
NON_REGULAR: dict[str, Callable[[Path, bytes], None]] = {
    "directory": lambda p, _: p.mkdir(),
    "symlink loop": lambda p, _: p.symlink_to(p.name),
    "dangling symlink": lambda p, _: p.symlink_to("does-not-exist"),
    "FIFO": lambda p, _: _fifo(p),
    "symlink to /dev/zero": lambda p, _: p.symlink_to("/dev/zero"),
    "symlink to /dev/null": lambda p, _: p.symlink_to("/dev/null"),
    "socket": lambda p, _: _socket(p),
    "character device": lambda p, _: _char_device(p),
    "symlink out of the cache (same bytes)": _outside_copy,
    "symlink to a copy inside the cache": _inside_copy,
}

#: Kinds that need root (mknod): skipped as another user.
NEEDS_ROOT = frozenset({"character device"})


def cleanup_extras(path: Path) -> None:
    """Remove the helpers some `NON_REGULAR` kinds leave beside a cache."""
    for p in [*path.glob("copy-of-*"), *path.parent.glob("outside-*")]:
        remove_any(p)
