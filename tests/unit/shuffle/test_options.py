"""shuffle.options: a shuffle's keywords are the token selection's and `ShuffleOptions`' fields; the
default memory budget."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss
from saev_shards.selection import SelectionSpec
from saev_shards.shuffle import (
    ShuffleOptions,
    make_plan,
    options,
    plan_shuffle,
    shuffle_cache,
)

from ...support.caches import small_metadata, write_cache


def source(root: Path, **changes: Any) -> tuple[ss.Shards, np.ndarray[Any, Any], dict[str, Any]]:
    """A small source cache (23 examples, CLS + 4 tokens, 2 layers); returns it, its data and write kwargs."""
    kwargs: dict[str, Any] = {k: changes.pop(k) for k in ("labels", "lengths") if k in changes}
    md = small_metadata(**changes)
    logical = write_cache(root, md, **kwargs)
    return ss.open(root / md.hash), logical, kwargs


def test_the_keywords_are_the_selection_and_the_options(root: Path) -> None:
    """`plan_shuffle` and `shuffle_cache` take the fields of `SelectionSpec` and `ShuffleOptions` as
    keywords (their signatures say so), refuse any other as Python does, and plan what `make_plan`
    plans from the two objects."""
    src, _, _ = source(root)
    fields = [f.name for cls in (SelectionSpec, ShuffleOptions) for f in dataclasses.fields(cls)]
    for fn, own in ((plan_shuffle, ["progress"]), (shuffle_cache, ["progress", "durable"])):
        names = list(inspect.signature(fn).parameters)
        assert names == ["source", "root", *fields, *own]
        with pytest.raises(TypeError, match=rf"^{fn.__name__}\(\) got an unexpected keyword argument 'seeds'$"):
            fn(src, seeds=1)
    made = make_plan(src, src.path.parent, SelectionSpec(layers=[11]), ShuffleOptions(seed=3, dtype="float32"))
    assert made.to_json() == plan_shuffle(src, layers=[11], seed=3, dtype="float32").to_json()
    with pytest.raises(ss.ShuffleError, match="workers: expected an integer >= 1, found 0"):
        ShuffleOptions(workers=0)


# -- the default budget: half the cgroup's memory limit where that is below the default ---------

MOUNTINFO = """\
25 24 0:24 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
35 25 0:30 / {root}/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
36 25 0:31 / {root}/memory rw,relatime shared:11 - cgroup cgroup rw,memory
37 25 0:32 / {root}/cpu rw,relatime shared:12 - cgroup cgroup rw,cpu
"""


def fake_cgroups(tmp_path: Path, v1: dict[str, str], v2: dict[str, str], cgroup: str) -> tuple[Path, Path]:
    """/proc/self/cgroup and /proc/self/mountinfo of a process in ``cgroup`` (both hierarchies)
    whose folders (relative paths) hold the given limit files' text."""
    for kind, files, name in (("memory", v1, "memory.limit_in_bytes"), ("unified", v2, "memory.max")):
        for folder, text in files.items():
            path = tmp_path / kind / folder.lstrip("/")
            path.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(text + "\n")
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text(f"4:memory:{cgroup}\n1:cpu:/\n0::{cgroup}\n")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO.format(root=tmp_path))
    return proc_cgroup, mountinfo


@pytest.mark.parametrize(
    ("v1", "v2", "expected"),
    [
        ({}, {}, None),  # nothing set
        ({"/": "9223372036854771712", "/job": "9223372036854771712"}, {"/job": "max"}, None),  # unlimited
        ({"/job": str(3 << 30)}, {}, 3 << 30),  # v1, the process's own cgroup
        ({}, {"/job": "max", "/": str(1 << 30)}, 1 << 30),  # v2, an ancestor's
        ({"/job/step": str(6 << 30), "/job": str(5 << 30)}, {"/job/step": str(7 << 30)}, 5 << 30),  # the tightest
    ],
)
def test_the_cgroup_memory_limit_is_the_tightest_of_the_process_cgroup_and_its_ancestors(
    tmp_path: Path, v1: dict[str, str], v2: dict[str, str], expected: int | None
) -> None:
    proc_cgroup, mountinfo = fake_cgroups(tmp_path, v1, v2, "/job/step")
    assert options.cgroup_memory_limit(proc_cgroup, mountinfo) == expected
    default = options.default_memory(proc_cgroup, mountinfo)
    assert default == (options.DEFAULT_MEMORY if expected is None else min(options.DEFAULT_MEMORY, expected // 2))


def test_the_default_budget_follows_the_cgroup_limit(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No budget given: half the limit of the process's cgroup (1 GiB of a 2 GiB limit); one
    given is taken as it is; without a readable cgroup, `DEFAULT_MEMORY`."""
    src, _, _ = source(root)
    proc_cgroup, mountinfo = fake_cgroups(root / "fake", {"/job": str(2 << 30)}, {}, "/job")
    monkeypatch.setattr(options.default_memory, "__defaults__", (proc_cgroup, mountinfo))
    assert plan_shuffle(src).memory_bytes == 1 << 30
    assert plan_shuffle(src, memory_bytes=3 << 30).memory_bytes == 3 << 30
    monkeypatch.setattr(options.default_memory, "__defaults__", (root / "missing", mountinfo))
    assert plan_shuffle(src).memory_bytes == options.DEFAULT_MEMORY
