"""Optional dependencies: imported only when a feature needs them, with an error naming the extra."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shlex
from pathlib import Path
from types import ModuleType

from .errors import MissingDependencyError

#: The distribution this package is installed as (``pip install -e .`` or its wheel).
DISTRIBUTION = "saev-shards"


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``, or raise `MissingDependencyError` saying how to install the ``extra``.

    ``purpose`` completes "... needs <package>": e.g. ``"converting zarr sources"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".", maxsplit=1)[0]
        raise MissingDependencyError(
            f"{purpose} needs {package}, which is not installed ({err}); install it with: {install_hint(extra)}"
        ) from None


def install_hint(extra: str) -> str:
    """A pip command that installs ``extra`` where this package came from.

    saev-shards is installed from a checkout or from a wheel built by ``make dist``, not
    from a package index, so ``pip install 'saev-shards[torch]'`` finds nothing. From a
    checkout (an editable install: ``pyproject.toml`` beside the package) the command
    names the checkout; from a wheel it lists the extra's exact requirements, which the
    installed distribution records.
    """
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return f"pip install -e {shlex.quote(f'{checkout}[{extra}]')}"
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    marker = re.compile(rf"""^(.*?);\s*extra\s*==\s*["']{re.escape(extra)}["']\s*$""")
    wanted = [m.group(1).strip() for r in requires if (m := marker.match(r))]
    if not wanted:
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    return "pip install " + " ".join(shlex.quote(r) for r in wanted) + f" (the [{extra}] extra of {DISTRIBUTION})"
