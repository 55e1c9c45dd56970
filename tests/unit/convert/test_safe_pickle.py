"""convert.safe_pickle: pickles that may hold only numpy arrays, dtypes and plain containers."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from saev_shards.convert import safe_pickle
from saev_shards.errors import (
    UnsafePickleError,
)


class _Exploit:
    """A payload whose unpickling would create a file: ``open(path, "w")``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


class _Shell:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/saev-shards-pwned",))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"layer_0": [{"sample_idx": 0, "activation": _Exploit(marker)}]}, protocol=protocol)
    with pytest.raises(UnsafePickleError, match=r"refusing to load builtins\.open|refusing to load io\.open"):
        safe_pickle.load(payload, tmp_path / "x.pkl")
    assert not marker.exists()
    with pytest.raises(UnsafePickleError, match=r"refusing to load (posix|os|nt)\.system"):
        safe_pickle.load(pickle.dumps(_Shell(), protocol=protocol), tmp_path / "x.pkl")


def test_safe_loader_reads_numpy_and_plain_containers(tmp_path: Path) -> None:
    value = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": [np.float16(1.5), np.int64(7), (1, 2), {3, 4}, frozenset([5]), 1 + 2j, b"raw", None, True],
        "c": np.array([1, 2], dtype=">i4"),
        "d": np.dtype("<f8"),
    }
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        got = safe_pickle.load(pickle.dumps(value, protocol=protocol), tmp_path / "ok.pkl")
        np.testing.assert_array_equal(got["a"], value["a"])
        assert got["b"] == value["b"]
        assert got["c"].tolist() == [1, 2]  # (numpy itself keeps the byte order only in protocol 5)
        assert got["d"] == np.dtype("<f8")
