"""`benchmarks/gpu.py`: docs/bench/gpu.md rendered from a results file says what each figure
is limited by and what would close each gap, from the figures alone; a part that did not
finish is named; the stack sampler files a thread under the stage it is in; and (slow) the
benchmark runs end to end on a small cache here, CPU only, and its results render."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu as bg
from benchmarks import gpu_results as gr

REPO = Path(__file__).resolve().parents[2]


def loader_row(gbps: float, profile: dict[str, list[list[Any]]], **fields: Any) -> dict[str, Any]:
    return {"gbps": gbps, "vectors_per_s": gbps * 1e9 / 1536, "first_batch_s": 0.9, "cpu_s_per_gb": 0.2,
            "cores_busy": 2.0, "batches": 100, "seconds": 3.0, "bytes_per_vector": 1536, "profile": profile,
            **fields}  # fmt: skip


def table(part: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": f"gpu_{part}", "title": f"the {part} table", "columns": ["a", "b"], "rows": [["1", "2"]],
            "notes": [f"{part} note"], "data": rows}  # fmt: skip


UPLOAD_BOUND = {"main": [["batch [wait]", 0.9]], "read": [["upload wait", 0.6], ["read", 0.3]]}
READ_BOUND = {"main": [["batch [wait]", 0.8]], "read": [["read", 0.9]]}


def gpu_results() -> dict[str, Any]:
    """A results file as a GPU session writes it (figures made up, shapes real)."""
    modes = [
        loader_row(9.0, READ_BOUND, mode="device-side shuffle (cuda)", kind="device"),
        loader_row(4.0, UPLOAD_BOUND, mode="stacked layers (B, 2, D), device (cuda)", kind="device"),
        loader_row(5.0, {"main": [["loop", 0.8]], "read": [["idle [wait]", 0.7]]}, mode="host gather", kind="host"),
        loader_row(6.0, READ_BOUND, mode="host gather, pin_memory", kind="host"),
    ]
    float8 = [
        loader_row(9.0, READ_BOUND, mode="device-side shuffle (cuda), layer 11", cache="float16"),
        loader_row(
            8.0, READ_BOUND, mode="device-side shuffle (cuda), layer 11", cache="float8_e4m3", vectors_per_s=8e9 / 772
        ),
    ]
    cold = [
        {"reader": "sequential O_DIRECT reads, 8 MiB requests", "limit": True, "threads": 1, "gbps": 2.0},
        {"reader": "buffered 4 MiB preads in file order", "limit": True, "threads": 16, "gbps": 3.0},
        loader_row(2.9, READ_BOUND, reader="ShuffledLoader, float16, every layer, device-side shuffle", limit=False),
        loader_row(
            1.5, {"read": [["index", 0.5], ["read", 0.4]]}, reader="ShuffledLoader, float16, layer 11", limit=False
        ),
    ]
    sae = [
        {"data": "already on the device", "tokens_per_s": 2e6, "ratio": 1.0, "loader_gbps_needed": 3.07},
        {"data": "float16, device-side shuffle", "tokens_per_s": 1.99e6, "ratio": 0.995, "loader_gbps_needed": 3.06},
        {"data": "float16, host gather, pin_memory", "tokens_per_s": 1.8e6, "ratio": 0.9, "loader_gbps_needed": 2.76},
    ]
    parts = {p: {"status": "ok", "seconds": 10.0} for p in gr.PARTS}
    parts["cuda_tests"] = {"status": "exit 0: 40 passed in 31.2s", "seconds": None}
    return {
        "schema": 1, "started": "2026-11-28 10:00 UTC",
        "machine": {"summary": "AMD EPYC, 16 cores, 128 GiB RAM, Python 3.12.3, numpy 2.5.2", "usable_cores": 16,
                    "kernel": "6.18.44-fc", "torch": "2.11.0+cu130", "cuda": True, "gpu": "NVIDIA H100 80GB HBM3",
                    "gpu_memory_gib": 79.2, "gpu_sms": 132, "cuda_runtime": "13.0", "driver": "580.159.04",
                    "pcie": "gen 5 x16 (max gen 5 x16)", "numba": "0.62.0", "float8_kernels": True,
                    "filesystem": "ext4 (/dev/vda on /)", "readahead_kb": 128},
        "caches": {"float16": {"examples": 13219, "shards": 16, "nbytes": 8.0e9, "write_seconds": 6.1, "writers": 16}},
        "limits": {"pread": 10.0, "h2d": 50.0, "h2d_pageable": 8.0, "read_upload": 9.5, "disk": 3.0},
        "cold": {"method": "drop_caches", "sync_seconds": 3.0, "cached_gb_before_drop": 13.0,
                 "cached_gb_after_drop": 0.5, "disk": 3.0},
        "tables": {"limits": table("limits", []), "modes": table("modes", modes), "float8": table("float8", float8),
                   "sae": table("sae", sae), "cold": table("cold", cold)},
        "parts": parts,
    }  # fmt: skip


def test_the_page_has_every_section_and_judges_every_target() -> None:
    page = gr.render(gpu_results())
    for heading in ("# GPU node benchmark", "## The machine", "## The tests on this GPU", "## The tables",
                    "## What limits each row", "## Targets, and what would close each gap"):  # fmt: skip
        assert f"\n{heading}\n" in f"\n{page}", heading
    assert "NVIDIA H100 80GB HBM3" in page and "PCIe gen 5 x16" in page and "exit 0: 40 passed" in page
    assert "did not finish" not in page and "?" not in page.split("## The tables")[0]
    for t in ("limits", "modes", "float8", "sae", "cold"):
        assert f"### the {t} table" in page and f"{t} note" in page
    targets = page.split("## Targets")[1]
    assert "| page-cached, device-side shuffle (cuda) | >= 0.8 of pread | 0.90 | yes |" in targets
    assert "| page-cached, stacked layers (B, 2, D), device (cuda) | >= 0.8 of pread | 0.40 | no |" in targets
    assert (
        "| cold, ShuffledLoader, float16, every layer, device-side shuffle | >= 0.9 of the disk | 0.97 | yes |"
        in targets
    )
    assert "| SAE step, float16, device-side shuffle | >= 0.98 of on-device | 0.995 | yes |" in targets
    assert "| SAE step, float16, host gather, pin_memory | >= 0.98 of on-device | 0.900 | no |" in targets
    # float8 at 8 GB/s of 772-byte vectors against float16 at 9 GB/s of 1536-byte ones
    assert (
        "| float8 / float16 tokens/s, device-side shuffle (cuda), layer 11 | > 1 (half the bytes) | 1.77 | yes |"
        in targets
    )


def test_each_gap_gets_the_advice_of_what_limits_it() -> None:
    page = gr.render(gpu_results())
    advice = page.split("## Targets")[1]
    # the stacked device row: read threads waiting for uploads
    stacked = next(line for line in advice.splitlines() if line.startswith("- stacked layers"))
    assert "waiting for uploads" in stacked and "copy engines" in stacked
    # cold, layer 11: the window index on the read threads
    cold = next(line for line in advice.splitlines() if line.startswith("- cold, ShuffledLoader, float16, layer 11"))
    assert "window indexes" in cold and "0.50" in cold
    # the SAE row below target, fed by a loader (6 GB/s alone) with room for the 2.76 GB/s it needs
    sae = next(line for line in advice.splitlines() if line.startswith("- SAE step fed by float16, host gather"))
    assert "has the rate but slows the step" in sae
    limits = page.split("## What limits each row")[1].split("## Targets")[0]
    assert "host gather: 5.00 GB/s" in limits and "copying each batch to the GPU" in limits
    assert "Parallel pread into pinned memory peaks at 10.0 GB/s" in limits
    assert "reading and uploading together reach 9.5 GB/s" in limits


def test_parts_that_did_not_finish_are_named_and_nothing_is_invented() -> None:
    data = gpu_results()
    data["parts"]["cold"] = {"status": "stopped at its time limit (90s)", "seconds": None}
    del data["parts"]["threads"], data["tables"]["cold"], data["tables"]["sae"]
    page = gr.render(data)
    assert "Parts that did not finish: `cold` (stopped at its time limit (90s)); `threads` (not run)." in page
    assert "cold, ShuffledLoader" not in page and "SAE step" not in page
    empty = gr.render({"parts": {}})
    assert "No target could be judged" in empty and "`build` (not run)" in empty


def test_the_sampler_files_threads_under_their_stage() -> None:
    """An idle read thread (blocked in threading, no loader frame) counts as idle; a thread
    inside a function of `STAGES` as that stage; the sampler's own thread is left out."""
    stop = threading.Event()
    # a function named as the loaders' reading function, in a file named as theirs
    namespace: dict[str, Any] = {"stop": stop}
    exec(compile("def _read_block():\n    while not stop.is_set():\n        sum(range(1000))\n", "windows.py", "exec"),
         namespace)  # fmt: skip
    idle = threading.Thread(target=stop.wait, args=(30,), name="saev-loader-read_0")
    busy = threading.Thread(target=namespace["_read_block"], name="saev-loader-read_1")
    idle.start()
    busy.start()
    try:
        with bg.Sampler(interval=0.002) as sampler:
            threading.Event().wait(0.3)
    finally:
        stop.set()
        idle.join()
        busy.join()
    profile = dict(sampler.profile()["read"])
    assert profile.get("idle [wait]", 0) > 0.2 and profile.get("read", 0) > 0.2, profile
    assert set(sampler.counts) <= {"main", "read", "gather"}


@pytest.mark.slow
def test_the_benchmark_runs_on_a_cpu_and_renders(tmp_path: Path) -> None:
    """Every part on a 30 MB cache, without CUDA (device modes on the CPU), a second process
    per part as benchmarks/gpu_session.sh runs them; the page renders from what they wrote."""
    results = tmp_path / "gpu_results.json"
    env = {**os.environ, "SAEV_BENCH_DIR": str(tmp_path / "bench"), "SAEV_RESULTS_DIR": str(tmp_path / "tables")}
    base = [
        sys.executable,
        "benchmarks/gpu.py",
        "--gb",
        "0.03",
        "--seconds",
        "0.2",
        "--keep",
        "--results",
        str(results),
    ]
    for parts in ("build", "limits,modes,float8", "sae,cold,threads"):
        done = subprocess.run(
            [*base, "--parts", parts], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    data = json.loads(results.read_text())
    assert all(data["parts"][p]["status"] == "ok" for p in gr.PARTS), data["parts"]
    assert set(data["tables"]) == set(gr.PARTS) - {"build"}
    page = subprocess.run([*base[:2], "--render", str(results)], cwd=REPO, capture_output=True, text=True, check=True)
    assert "## Targets, and what would close each gap" in page.stdout and "GPU: none" in page.stdout
    marked = subprocess.run([*base[:2], "--results", str(results), "--mark", "cold", "stopped at its time limit"],
                            cwd=REPO, capture_output=True, text=True, check=True)  # fmt: skip
    assert marked.returncode == 0
    assert "`cold` (stopped at its time limit)" in gr.render(json.loads(results.read_text()))
