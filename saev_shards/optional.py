"""Optional dependencies: imported only when a feature needs them, with an error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise `MissingDependencyError` saying ``pip install 'saev-shards[extra]'``.

    ``purpose`` completes "... needs <package>": e.g. ``"converting zarr sources"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".", maxsplit=1)[0]
        raise MissingDependencyError(
            f"{purpose} needs {package}, which is not installed ({err}); "
            f"install it with: pip install 'saev-shards[{extra}]'"
        ) from None
