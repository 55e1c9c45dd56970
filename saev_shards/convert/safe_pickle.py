"""Load pickles that may only hold numpy arrays, dtypes and plain containers.

A pickle is a program: unpickling calls whatever callables it names, so a pickle from
someone else can run any code (``os.system``, ``open(..., "w")``, ...). Seed 001's shards
only need numpy arrays, numpy scalars and dtypes inside dicts, lists, tuples, strings and
numbers, so `load` resolves exactly the globals that rebuild those and refuses every other
one with `UnsafePickleError` before it is called: nothing the pickle names runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

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


class _Restricted(pickle.Unpickler):
    def __init__(self, file: BinaryIO, where: Path) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafePickleError(
                f"{self.where}: refusing to load {module}.{name}: the pickle asks for something other than "
                "numpy arrays, dtypes and plain containers, and unpickling it could run code; nothing was run"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self.where}: refusing a persistent id ({pid!r}); nothing was run")


def load(data: bytes | BinaryIO, where: Path) -> Any:
    """Unpickle ``data`` (bytes or a binary file) allowing only `ALLOWED_GLOBALS`.

    Raises `UnsafePickleError` for anything else and `ConvertError` for a malformed pickle.
    """
    file = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        return _Restricted(file, where).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise ConvertError(f"{where}: not a readable pickle ({type(err).__name__}: {err})") from None
