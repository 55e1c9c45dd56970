"""The earlier import paths of modules that moved into packages, kept working for users.

`MOVED` maps each earlier name under ``saev_shards`` to the module that holds its code now.
A finder at the end of `sys.meta_path` answers an import of an earlier name with that very
module, imported when first asked for: ``import saev_shards.layout`` and ``from
saev_shards.recorder import Recorder`` work as before, both names are one module object (a
patch through either is seen through the other; pickles that name an old path load), and
nothing is imported before it is asked for (``import saev_shards`` still imports no torch).
``saev_shards.<name>`` as an attribute goes through the package's ``__getattr__`` (`attribute`).

Inside the library, modules import the new homes; `MOVED` is only for code outside it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

PACKAGE = __name__.rpartition(".")[0]

#: Earlier module name -> its home now, both relative to the package.
MOVED: dict[str, str] = {
    # The format: every byte rule in `protocol`, the compute engines in `codecs`.
    "layout": "protocol.layout",
    "metadata": "protocol.metadata",
    "manifest": "protocol.manifest",
    "format": "protocol",
    "float8": "codecs.float8",
    "float8_kernels": "codecs._float8_numba",
    "dtypes": "codecs.dtypes",
    # Each module beside the package that alone uses it.
    "corpus": "dump.corpus",
    "recorder": "dump.recorder",
    "sae": "demo.sae",
    "views": "reader.views",
    "report": "reader.report",
    "norms": "reader.norms",
    "_indexing": "reader.indexing",
    "units": "humanize",
    "datasets": "loaders",
    # The one token selection, below the loaders and the shuffle.
    "_layers": "selection.layers",
    "token_masks": "selection.token_masks",
}


class _Alias(importlib.abc.Loader):
    """Loads an earlier name as the module ``target`` itself."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the module's __spec__ to the alias's: give it its own back.
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the earlier names of `MOVED` (after every other finder has found nothing)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"{PACKAGE}.{MOVED[name]}"))


def install() -> None:
    """Put the finder on `sys.meta_path` (once per process; importing this module does)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())


def attribute(name: str) -> ModuleType:
    """``saev_shards.<name>`` for an earlier module name (the package's ``__getattr__``);
    `AttributeError` for any other name."""
    if name not in MOVED:
        raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")
    return importlib.import_module(f"{PACKAGE}.{name}")


install()
