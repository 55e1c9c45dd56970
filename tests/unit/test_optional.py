"""`saev_shards.optional`: an optional dependency imported when a feature needs it, or an
error that names the feature, the package and the pip command that installs its extra."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from saev_shards import optional
from saev_shards.errors import MissingDependencyError


def test_require_returns_the_module() -> None:
    assert optional.require("json", "any", "reading JSON") is json


def test_require_names_the_purpose_the_package_and_the_install_command() -> None:
    with pytest.raises(MissingDependencyError) as info:
        optional.require("no_such_package_here.sub", "zarr", "converting zarr sources")
    message = str(info.value)
    assert message.startswith("converting zarr sources needs no_such_package_here, which is not installed")
    assert message.endswith(optional.install_hint("zarr"))


def test_the_install_hint_from_a_checkout_names_the_checkout() -> None:
    checkout = Path(optional.__file__).resolve().parents[1]
    assert (checkout / "pyproject.toml").is_file()  # the tests run from a checkout
    assert optional.install_hint("torch") == f"pip install -e {shlex.quote(f'{checkout}[torch]')}"
