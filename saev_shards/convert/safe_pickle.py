"""Load pickles that may only hold numpy arrays, dtypes and plain containers, within a size budget.

A pickle is a program: unpickling calls whatever callables it names, so a pickle from
someone else can run any code (``os.system``, ``open(..., "w")``, ...). The pickle.gz
activation shards only need numpy arrays, numpy scalars and dtypes inside dicts, lists,
tuples, strings and numbers, so `load` resolves exactly the globals that rebuild those and refuses every other
one with `UnsafePickleError` before it is called: nothing the pickle names runs.

Even those few callables allocate what they are told: ``bytearray(2**40)``, an array
rebuilt with the shape ``(2**40,)``, a memo slot at index ``2**31`` are each a few bytes of
pickle that ask for gigabytes. So before anything is unpickled, `scan` walks the opcodes
(declared lengths within the data, memo indices in sequence, no extension codes, no
out-of-band buffers), and every allowed constructor is wrapped to check the size it would
allocate against the budget (``max_bytes``) and to refuse object arrays. After unpickling,
`_plain` checks what came out: allowed types only, at most `MAX_DEPTH` levels, no cycles.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import ConvertError, UnsafePickleError

#: ``(module, name)`` pairs a shard may name. numpy's array and scalar rebuilders under both
#: the numpy 1 (``numpy.core``) and numpy 2 (``numpy._core``) module names; ``_codecs.encode``
#: turns a str into bytes (protocol 2 pickles of bytes use it); sets, complex numbers and
#: ordered dicts are plain containers and values. Protocol 2 pickles spell builtins
#: ``__builtin__``.
ALLOWED_GLOBALS = frozenset(
    [
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        *(
            (core, name)
            for core in ("numpy.core.multiarray", "numpy._core.multiarray")
            for name in ("_reconstruct", "scalar")
        ),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
        ("codecs", "encode"),
        *((mod, name) for mod in ("builtins", "__builtin__") for name in ("set", "frozenset", "complex", "bytearray")),
        ("collections", "OrderedDict"),
    ]
)
#: Deepest nesting of containers a shard may hold (the pickle-shards format nests 4: dict, list, record, metadata).
MAX_DEPTH = 32
#: Encodings ``_codecs.encode`` may be asked for: what pickles of bytes use. (Codecs such as
#: ``hex_codec`` double their input: nested calls would grow without bound.)
_ENCODINGS = frozenset(["latin1", "latin-1", "latin_1", "iso-8859-1", "iso8859-1", "l1", "ascii", "utf-8", "utf8"])
#: Opcodes a shard never needs: extension registry codes (globals by number), persistent ids,
#: out-of-band buffers.
_REFUSED_OPCODES = frozenset(["EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER"])
_MEMO_PUT = frozenset(["PUT", "BINPUT", "LONG_BINPUT"])
_MEMO_GET = frozenset(["GET", "BINGET", "LONG_BINGET"])
_OPCODES = {ord(op.code): op for op in pickletools.opcodes}
_LENGTH_PREFIX = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def load(data: bytes | BinaryIO, where: Path, *, max_bytes: int | None = None) -> Any:
    """Unpickle ``data`` (bytes or a binary file) allowing only `ALLOWED_GLOBALS`, and no
    constructor call that would allocate more than ``max_bytes`` (default: 8 times the data).

    Raises `UnsafePickleError` for a global outside the list, and `ConvertError` for a
    malformed pickle or one that asks for more than the budget.
    """
    raw = data if isinstance(data, (bytes, bytearray, memoryview)) else data.read()
    budget = _Budget(where, 8 * len(raw) + (1 << 20) if max_bytes is None else max_bytes)
    scan(raw, where)
    try:
        value = _Restricted(io.BytesIO(raw), where, budget).load()
    except (UnsafePickleError, ConvertError):
        raise
    except MemoryError:
        raise ConvertError(f"{where}: not enough memory to unpickle it ({len(raw):,} bytes of pickle)") from None
    except Exception as err:  # the C unpickler and numpy's rebuilders raise many kinds for malformed data
        raise ConvertError(f"{where}: not a readable pickle ({type(err).__name__}: {_short(err)})") from None
    return _plain(value, where)


def scan(data: bytes | bytearray | memoryview, where: Path) -> None:
    """Check the opcodes of ``data`` before it is unpickled (`ConvertError` naming the first
    problem): every declared length within the data, memo slots filled in sequence (a slot
    far ahead makes the unpickler allocate up to it), no extension code, persistent id or
    out-of-band buffer, a known protocol, and a STOP at the end. Payloads are skipped, not
    copied: about a microsecond per opcode."""
    view = memoryview(data)
    size = len(view)
    pos = 0
    memo = 0
    while True:
        if pos >= size:
            raise ConvertError(f"{where}: not a readable pickle (it ends before its STOP opcode, at byte {pos:,})")
        op = _OPCODES.get(view[pos])
        if op is None:
            raise ConvertError(f"{where}: not a readable pickle (unknown opcode {view[pos]:#04x} at byte {pos:,})")
        at = pos
        pos += 1
        if op.name in _REFUSED_OPCODES:
            raise UnsafePickleError(f"{where}: refusing the {op.name} opcode at byte {at:,}; nothing was run")
        arg = op.arg
        value: int | None = None
        if arg is None:
            pass
        elif arg.n >= 0:
            if pos + arg.n > size:
                raise _truncated(where, op.name, at)
            if op.name in ("BINGET", "BINPUT", "LONG_BINGET", "LONG_BINPUT", "PROTO"):
                value = int.from_bytes(view[pos : pos + arg.n], "little")
            pos += arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            lines = 2 if op.name in ("GLOBAL", "INST") else 1
            text = b""
            for _ in range(lines):
                end = _newline(view, pos, size)
                if end < 0:
                    raise _truncated(where, op.name, at)
                text = bytes(view[pos:end])
                pos = end + 1
            if op.name in ("PUT", "GET"):
                value = int(text) if text.isdigit() and len(text) < 20 else -1
        else:
            width, signed = _LENGTH_PREFIX[arg.n]
            if pos + width > size:
                raise _truncated(where, op.name, at)
            length = int.from_bytes(view[pos : pos + width], "little", signed=signed)
            pos += width
            if length < 0 or length > size - pos:
                raise ConvertError(
                    f"{where}: not a readable pickle ({op.name} at byte {at:,} declares {length:,} bytes, "
                    f"{size - pos:,} remain)"
                )
            if op.name != "FRAME":  # a frame's bytes are opcodes: scanned as they come
                pos += length
        if op.name == "PROTO" and value is not None and value > pickle.HIGHEST_PROTOCOL:
            raise ConvertError(f"{where}: not a readable pickle (protocol {value}, at most {pickle.HIGHEST_PROTOCOL})")
        if op.name in _MEMO_PUT or op.name == "MEMOIZE":
            index = memo if op.name == "MEMOIZE" else value
            if index is None or not 0 <= index <= memo:
                raise ConvertError(
                    f"{where}: not a readable pickle (memo slot {index} at byte {at:,}; the next free one is {memo})"
                )
            memo += index == memo
        elif op.name in _MEMO_GET and (value is None or not 0 <= value < memo):
            raise ConvertError(
                f"{where}: not a readable pickle (memo slot {value} read at byte {at:,} was never filled)"
            )
        if op.name == "STOP":
            return


def _newline(view: memoryview, start: int, size: int) -> int:
    # Text arguments (protocol 0, GLOBAL names) are short: look a bounded way ahead.
    end = bytes(view[start : min(size, start + 4096)]).find(b"\n")
    return -1 if end < 0 else start + end


def _truncated(where: Path, name: str, at: int) -> ConvertError:
    return ConvertError(f"{where}: not a readable pickle (truncated in the argument of {name} at byte {at:,})")


def _short(err: BaseException, limit: int = 200) -> str:
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "..."


class _Budget:
    """Bytes the constructors of one pickle may still allocate."""

    def __init__(self, where: Path, nbytes: int) -> None:
        self.where = where
        self.left = nbytes
        self.total = nbytes

    def take(self, nbytes: int, what: str) -> None:
        if nbytes > self.left:
            raise ConvertError(
                f"{self.where}: the pickle asks for {what} of {nbytes:,} bytes, more than the "
                f"{self.total:,} bytes it may use in all (its share of --max-memory); nothing was allocated"
            )
        self.left -= nbytes


def _plain_dtype(dtype: object, where: Path) -> np.dtype[Any]:
    if not isinstance(dtype, np.dtype):
        raise ConvertError(f"{where}: not a readable pickle (expected a numpy dtype, found {type(dtype).__name__})")
    if dtype.hasobject:
        raise UnsafePickleError(f"{where}: refusing an array of Python objects (dtype {dtype}); nothing was run")
    return dtype


def _shape(shape: object, where: Path) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not (
        isinstance(shape, tuple)
        and len(shape) <= 64
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**62 for n in shape)
    ):
        raise ConvertError(f"{where}: not a readable pickle (an array shape of {_short(ValueError(repr(shape)), 80)})")
    return shape


class _CheckedArray(np.ndarray):
    """What `_reconstruct` builds while unpickling: its state is checked before numpy takes it
    (shape within the budget, no objects, raw bytes of exactly the right length); `_plain`
    turns every one into a plain ndarray."""

    _saev_check: Callable[[tuple[Any, ...]], None] | None = None
    _saev_where: Path | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        raise UnsafePickleError(
            f"{cls._saev_where}: refusing to call numpy.ndarray directly (arrays are rebuilt, never constructed); "
            "nothing was run"
        )

    def __setstate__(self, state: Any) -> None:
        check = type(self)._saev_check
        if check is None or not isinstance(state, tuple):
            raise UnsafePickleError("refusing an array state outside a checked unpickling")
        check(state)
        super().__setstate__(state)


class _Restricted(pickle.Unpickler):
    def __init__(self, file: BinaryIO, where: Path, budget: _Budget) -> None:
        super().__init__(file)
        self.where = where
        self.budget = budget
        # One subclass per load: its check knows this pickle's budget and name.
        self.array_type = type(
            "_CheckedArray", (_CheckedArray,), {"_saev_check": staticmethod(self._array_state), "_saev_where": where}
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"{self.where}: refusing to load {module}.{name}: the pickle asks for something other than "
                "numpy arrays, dtypes and plain containers, and unpickling it could run code; nothing was run"
            )
        wrapped = {
            "ndarray": self.array_type,
            "dtype": self._dtype,
            "_reconstruct": self._reconstruct,
            "scalar": self._scalar,
            "_frombuffer": self._frombuffer,
            "encode": self._encode,
            "bytearray": self._bytearray,
            "set": self._container(set),
            "frozenset": self._container(frozenset),
            "complex": self._complex,
            "OrderedDict": OrderedDict,
        }
        return wrapped[name]

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.where}: refusing a persistent id ({pid!r:.80}); nothing was run")

    # -- the allowed constructors, each checked for what it would allocate ----------------
    def _dtype(self, *args: Any) -> np.dtype[Any]:
        if not args or not isinstance(args[0], str) or len(args[0]) > 64:
            raise UnsafePickleError(
                f"{self.where}: refusing a dtype built from {type(args[0] if args else None).__name__}"
            )
        dtype = _plain_dtype(np.dtype(*args), self.where)
        self.budget.take(dtype.itemsize, "a dtype")
        return dtype

    def _reconstruct(self, subtype: Any, shape: Any, typecode: Any) -> Any:
        if subtype is not self.array_type:
            raise UnsafePickleError(f"{self.where}: refusing to rebuild {getattr(subtype, '__name__', subtype)!r:.80}")
        dims = _shape(shape, self.where)
        if not isinstance(typecode, (bytes, str)) or len(typecode) > 8:
            raise ConvertError(f"{self.where}: not a readable pickle (array type code {typecode!r:.40})")
        code = typecode if isinstance(typecode, str) else typecode.decode("latin-1")
        dtype = _plain_dtype(np.dtype(code), self.where)
        self.budget.take(math.prod(dims) * dtype.itemsize, f"an array of shape {dims}")
        return np.ndarray.__new__(self.array_type, dims, dtype)

    def _array_state(self, state: tuple[Any, ...]) -> None:
        if len(state) == 5:
            state = state[1:]
        if len(state) != 4:
            raise ConvertError(f"{self.where}: not a readable pickle (an array state of {len(state)} fields)")
        shape, dtype, _fortran, raw = state
        dims = _shape(shape, self.where)
        dtype = _plain_dtype(dtype, self.where)
        nbytes = self._check_data(raw, dims, dtype)
        self.budget.take(nbytes, f"an array of shape {dims}")

    def _check_data(self, data: Any, dims: tuple[int, ...], dtype: np.dtype[Any]) -> int:
        """The bytes an array of ``dims`` and ``dtype`` needs, once ``data`` is exactly that many."""
        nbytes = math.prod(dims) * dtype.itemsize
        if not isinstance(data, (bytes, bytearray)) or len(data) != nbytes:
            found = f"{len(data):,} bytes" if isinstance(data, (bytes, bytearray)) else type(data).__name__
            raise ConvertError(
                f"{self.where}: not a readable pickle (an array of shape {dims} {dtype} needs {nbytes:,} bytes "
                f"of data, found {found})"
            )
        return nbytes

    def _scalar(self, dtype: Any, data: Any = None) -> Any:
        dtype = _plain_dtype(dtype, self.where)
        if not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise ConvertError(f"{self.where}: not a readable pickle (a {dtype} scalar from {type(data).__name__})")
        return np.frombuffer(data, dtype)[0].copy()

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> Any:
        dtype = _plain_dtype(dtype, self.where)
        dims = _shape(shape, self.where)
        self._check_data(buf, dims, dtype)
        if order not in ("C", "F"):
            raise ConvertError(f"{self.where}: not a readable pickle (array order {order!r:.20})")
        return np.frombuffer(buf, dtype).reshape(dims, order=order)

    def _encode(self, obj: Any, encoding: Any = "utf-8", errors: Any = "strict") -> bytes:
        if not isinstance(obj, str) or not isinstance(encoding, str) or encoding.lower() not in _ENCODINGS:
            raise UnsafePickleError(f"{self.where}: refusing _codecs.encode with encoding {encoding!r:.40}")
        return obj.encode(encoding, "strict")

    def _bytearray(self, *args: Any) -> bytearray:
        if not args:
            return bytearray()
        source = args[0]
        if isinstance(source, (bytes, bytearray)) and len(args) == 1:
            return bytearray(source)
        if isinstance(source, str) and len(args) == 2 and isinstance(args[1], str) and args[1].lower() in _ENCODINGS:
            return bytearray(source, args[1])
        raise UnsafePickleError(f"{self.where}: refusing bytearray from {type(source).__name__} (only bytes)")

    def _container(self, kind: type[Any]) -> Callable[..., Any]:
        def build(*args: Any) -> Any:
            if len(args) > 1 or (args and not isinstance(args[0], (list, tuple))):
                raise UnsafePickleError(f"{self.where}: refusing {kind.__name__} from {type(args[0]).__name__}")
            return kind(*args)

        return build

    def _complex(self, *args: Any) -> complex:
        if len(args) > 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
            raise UnsafePickleError(f"{self.where}: refusing complex from {[type(a).__name__ for a in args]}")
        return complex(*args)


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None), np.generic, np.dtype)


def _plain(value: Any, where: Path) -> Any:
    """``value`` with every checked array a plain ndarray, after checking it holds only the
    allowed types, nested at most `MAX_DEPTH` deep, without cycles (iteratively: a
    pathological pickle cannot exhaust the stack here, nor in what reads the result)."""
    done: dict[int, Any] = {}
    # (container, depth); a container is rebuilt once all its children are done
    stack: list[tuple[Any, int, bool]] = [(value, 0, False)]
    open_ids: set[int] = set()
    while stack:
        node, depth, expanded = stack.pop()
        if isinstance(node, _SCALARS):
            continue
        if isinstance(node, np.ndarray):
            if node.dtype.hasobject:
                raise UnsafePickleError(f"{where}: refusing an array of Python objects; nothing was run")
            done[id(node)] = node.view(np.ndarray) if type(node) is not np.ndarray else node
            continue
        if not isinstance(node, (dict, list, tuple, set, frozenset)):
            raise UnsafePickleError(f"{where}: refusing a value of type {type(node).__name__}")
        key = id(node)
        if expanded:
            open_ids.discard(key)
            done[key] = _rebuild(node, done)
            continue
        if key in done:
            continue
        if key in open_ids:
            raise ConvertError(f"{where}: not a readable shard (a container holds itself)")
        if depth >= MAX_DEPTH:
            raise ConvertError(f"{where}: not a readable shard (nested deeper than {MAX_DEPTH} levels)")
        open_ids.add(key)
        stack.append((node, depth, True))
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else list(node)
        stack.extend((child, depth + 1, False) for child in children)
    return done.get(id(value), value)


def _rebuild(node: Any, done: dict[int, Any]) -> Any:
    def get(v: Any) -> Any:
        return done.get(id(v), v)

    if isinstance(node, dict):
        if not any(id(v) in done for v in node.values()):
            return node
        out = type(node)() if isinstance(node, OrderedDict) else {}
        for k, v in node.items():
            out[k] = get(v)
        return out
    if not any(id(v) in done for v in node):
        return node
    items = [get(v) for v in node]
    return items if isinstance(node, list) else type(node)(items)
