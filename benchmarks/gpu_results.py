"""The GPU node benchmark's results file (`gpu.py` writes it part by part) and the page made
from it, docs/bench/gpu.md: the machine, the tests' outcome, the tables, what limits each row
(from where the loader's threads spent their time) and what would close each gap, every
sentence computed from the file's own figures.

    .venv/bin/python benchmarks/gpu.py --render results/gpu_results.json > docs/bench/gpu.md
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import tables

PARTS = ("build", "limits", "modes", "float8", "sae", "cold", "threads")
TARGETS = {"page_cached": 0.8, "cold": 0.9, "sae": 0.98}
#: Test runs benchmarks/gpu_session.sh records in the results (``--mark``), in words.
TEST_RUNS = {
    "cuda_tests": "The tests that need CUDA (test_cuda.py, the pinned-batch test, the docs' GPU block)",
    "suite": "The loader, recorder and float8 tests under this node's Python, numpy and torch",
}
F16, F8 = "float16", "float8_e4m3"


# --------------------------------------------------------------------------------------
# the results file


class Results:
    """The results JSON: read at the start of each part, written after each table."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.exists():
            self.data: dict[str, Any] = json.loads(path.read_text())
        else:
            self.data = {
                "schema": 1,
                "started": now(),
                "machine": {},
                "caches": {},
                "limits": {},
                "cold": {},
                "tables": {},
                "parts": {},
            }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        os.replace(tmp, self.path)

    def table(self, part: str, table: tables.Table, rows: list[dict[str, Any]]) -> None:
        """Print ``table`` and keep it, with the figures behind each row (``rows``)."""
        table.emit()
        self.data["tables"][part] = {
            "name": table.name,
            "title": table.title,
            "columns": table.columns,
            "rows": table.rows,
            "notes": table.notes,
            "data": rows,
        }
        self.save()

    def part(self, name: str, status: str, seconds: float | None = None) -> None:
        self.data["parts"][name] = {"status": status, "seconds": seconds}
        self.save()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --------------------------------------------------------------------------------------
# docs/bench/gpu.md


def render(data: dict[str, Any]) -> str:
    """docs/bench/gpu.md from a results file: the machine, the tables, what limits each row,
    what would close each gap (every sentence computed from the file's own figures)."""
    m, tables, limits = data.get("machine", {}), data.get("tables", {}), data.get("limits", {})
    out = ["# GPU node benchmark", ""]
    out += [
        f"`make bench-gpu` (`benchmarks/gpu.py`), run {data.get('started', '?')} "
        + (
            "by `benchmarks/gpu_session.sh`, which also ran the tests that need a GPU (below). "
            if "cuda_tests" in data.get("parts", {})
            else "as `" + data.get("command", "benchmarks/gpu.py") + "`. "
        )
        + "Every ratio is to a limit of the same node measured in the same run. This page is written by "
        "`benchmarks/gpu.py --render` from that run's results file; edit the script, not the page.",
        "",
        "## The machine",
        "",
    ]
    out += _machine_lines(m, data)
    missing = [p for p in PARTS if p not in data.get("parts", {}) or data["parts"][p]["status"] != "ok"]
    if missing:
        out += ["", "Parts that did not finish: " + "; ".join(_part_status(data, p) for p in missing) + "."]
    tests = {k: v for k, v in data.get("parts", {}).items() if k in TEST_RUNS}
    if tests:
        out += ["", "## The tests on this GPU", ""]
        out += [f"- {TEST_RUNS[k]}: {v['status']}" for k, v in tests.items()]
    out += ["", "## The tables", ""]
    for t in tables.values():
        out += [f"### {t['title']}", "", *_md_table(t["columns"], t["rows"]), ""]
        out += [*t["notes"], ""] if t["notes"] else []
    out += ["## What limits each row", ""]
    out += _limits_section(tables, limits, data)
    out += ["", "## Targets, and what would close each gap", ""]
    out += _targets_section(tables, limits, data)
    return "\n".join(out).rstrip() + "\n"


def _part_status(data: dict[str, Any], part: str) -> str:
    got = data.get("parts", {}).get(part)
    if got is None:
        return f"`{part}` (not run)"
    return f"`{part}` ({got['status']})"


def _machine_lines(m: dict[str, Any], data: dict[str, Any]) -> list[str]:
    lines = [
        f"- CPU: {m.get('summary', '?')}; {m.get('usable_cores', '?')} usable cores; kernel {m.get('kernel', '?')}"
    ]
    if m.get("gpu"):
        lines.append(
            f"- GPU: {m['gpu']}, {m.get('gpu_memory_gib', '?')} GiB, {m.get('gpu_sms', '?')} SMs; driver "
            f"{m.get('driver', '?')}, CUDA runtime {m.get('cuda_runtime', '?')}; PCIe {m.get('pcie', '?')}"
        )
    elif "cuda" in m:
        lines.append("- GPU: none (CUDA not available): host parts only, device modes on the CPU")
    lines.append(
        f"- torch {m.get('torch', '?')}; numba {m.get('numba', 'absent')} (float8 kernels in use: "
        f"{m.get('float8_kernels', '?')})"
    )
    lines.append(f"- Benchmark files on {m.get('filesystem', '?')}, readahead {m.get('readahead_kb', '?')} KiB")
    for dtype, c in data.get("caches", {}).items():
        lines.append(
            f"- {dtype} cache: {c['examples']:,} examples x 2 layers x 197 tokens x 768, {c['nbytes'] / 1e9:.2f} GB "
            f"in {c['shards']} shards, written by {c['writers']} processes in {c['write_seconds']} s"
        )
    cold = data.get("cold", {})
    if cold:
        lines.append(
            f"- Cold samples: {cold['method']}; page cache {cold['cached_gb_before_drop']:.1f} GB before the "
            f"first drop, {cold['cached_gb_after_drop']:.1f} GB after it"
        )
    return lines


def _md_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


#: The stack sampler's stages (`STAGES`), in words.
PLACES = {
    "read": "reading (pread)",
    "upload wait": "waiting for an upload before refilling a host slot",
    "index": "computing window indexes",
    "upload": "queueing uploads",
    "gather": "gathering rows",
    "batch": "issuing batches",
    "batch [wait]": "waiting for a window or a batch",
    "idle [wait]": "idle",
    "loop": "the benchmark's loop (moving batches to the GPU, synchronising)",
}


def _words(place: str) -> str:
    return PLACES.get(place, f"`{place}`")


def _profile_text(profile: dict[str, list[list[Any]]]) -> str:
    parts = []
    names = {"main": "training loop", "read": "read threads", "gather": "gather threads"}
    for role in ("main", "read", "gather"):
        top = profile.get(role)
        if top:
            parts.append(f"{names[role]}: " + ", ".join(f"{_words(p)} {s:.0%}" for p, s in top[:3]))
    return "; ".join(parts)


def _share(profile: dict[str, list[list[Any]]], role: str, *keys: str) -> float:
    return float(sum(s for p, s in profile.get(role, []) if any(p.startswith(k) for k in keys)))


def _bottleneck(row: dict[str, Any], limits: dict[str, float]) -> str:
    """A sentence saying what limits a loader row, from its figures and its threads' profile."""
    prof = row.get("profile", {})
    reading = _share(prof, "read", "read")
    upload_wait = _share(prof, "read", "upload wait")
    idle_read = _share(prof, "read", "idle")
    main_wait = _share(prof, "main", "batch [wait]")
    main_busy = _share(prof, "main", "batch") - main_wait
    main_loop = _share(prof, "main", "loop") - _share(prof, "main", "loop [wait]")
    gather = _share(prof, "gather", "gather")
    indexing = _share(prof, "read", "index")
    if upload_wait >= 0.3:
        return (
            f"the read threads spend {upload_wait:.0%} of their time waiting for uploads: the host-to-device "
            "copies (or the slots they free) set the pace"
        )
    if indexing >= 0.3:
        return (
            f"the read threads spend {indexing:.0%} of their time computing window indexes (numpy, on the host): "
            "each window waits for its index"
        )
    if reading >= 0.5:
        return f"the read threads are reading {reading:.0%} of the time: reading (pread) sets the pace"
    if main_loop >= 0.5:
        return (
            f"the loop's own work, copying each batch to the GPU, takes {main_loop:.0%} of its thread: that copy "
            "sets the pace"
        )
    if main_busy >= 0.6 and idle_read >= 0.3:
        return (
            f"the training loop's thread is busy {main_busy:.0%} of the time and the read threads idle "
            f"{idle_read:.0%}: the per-batch work on the loop's thread sets the pace"
        )
    if gather >= 0.5:
        return f"the gather threads are gathering {gather:.0%} of the time: the host gather (CPU) sets the pace"
    if main_wait >= 0.5 and idle_read >= 0.3:
        return (
            f"the loop waits for windows {main_wait:.0%} of the time while the read threads idle {idle_read:.0%}: "
            "too few windows in flight (two slots) for the read threads to stay busy"
        )
    return "no single stage dominates the sampled stacks"


def _limits_section(tables: dict[str, Any], limits: dict[str, float], data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    pread, h2d, ru = limits.get("pread"), limits.get("h2d"), limits.get("read_upload")
    if "limits" in tables:
        text = (
            f"- **The node.** Parallel pread into pinned memory peaks at {pread:.1f} GB/s"
            if pread
            else "- **The node.**"
        )
        if h2d:
            text += f"; one pinned host-to-device copy stream moves {h2d:.1f} GB/s"
            if limits.get("h2d_pageable"):
                text += f" ({limits['h2d_pageable']:.1f} from pageable memory)"
        if ru:
            text += f"; reading and uploading together reach {ru:.1f} GB/s, " + (
                "the upload being the narrower of the two."
                if h2d and h2d < (pread or 0)
                else "so reads and uploads overlap."
                if pread and ru >= 0.9 * min(pread, h2d or pread)
                else "less than either alone: reads and uploads contend (memory bandwidth, or the copy engine)."
            )
        lines.append(text if text.endswith(".") else text + ".")
    for key, label in (("modes", "Loader modes"), ("float8", "float8"), ("cold", "Cold"), ("threads", "Threads")):
        t = tables.get(key)
        if t is None:
            continue
        lines.append(f"- **{label}.**")
        for row in t["data"]:
            if row.get("limit") or "profile" not in row:
                continue
            name = row.get("mode") or row.get("reader") or f"gather threads {row.get('gather_threads')}"
            if key == "float8":
                name = f"{name}, {row['cache']}"
            restart = (
                f" A new epoch's first batch came {row['restart_s']:.2f} s after the last one's end (the first "
                "window read and, on the device, uploaded before anything else); left out of the rate."
                if row.get("epoch_restarts")
                else ""
            )
            lines.append(
                f"  - {name}: {row['gbps']:.2f} GB/s, {row['cores_busy']:.1f} cores busy; "
                f"{_bottleneck(row, limits)} ({_profile_text(row['profile'])}).{restart}"
            )
    sae = tables.get("sae")
    if sae is not None:
        lines.append("- **SAE step.**")
        lines += _sae_lines(sae, tables)
    return lines


def _sae_lines(sae: dict[str, Any], tables: dict[str, Any]) -> list[str]:
    alone = _loader_alone(tables)
    lines = []
    for row in sae["data"]:
        if row["data"] == "already on the device":
            lines.append(f"  - on the device: {row['tokens_per_s']:,.0f} tokens/s, the GPU's own rate for this step.")
            continue
        need = row["loader_gbps_needed"]
        have = alone.get(row["data"])
        text = f"  - {row['data']}: {row['ratio']:.3f} of on-device, the loader delivering {need:.2f} GB/s"
        if row["ratio"] >= TARGETS["sae"]:
            text += ": the loader keeps up with the step"
        elif have is not None:
            text += f"; alone, page-cached, it delivers {have:.2f} GB/s"
            text += (
                ": it has room, so the gap is interference (its threads' CPU and GIL time, its uploads and "
                "gathers on the GPU) rather than its rate"
                if have >= 1.2 * need
                else ": the loader itself is the limit"
            )
        lines.append(text + ".")
    return lines


def _loader_alone(tables: dict[str, Any]) -> dict[str, float]:
    """The page-cached rate of the loader that feeds each SAE row, from the modes and float8 tables."""
    out = {}
    for row in tables.get("modes", {}).get("data", []):
        if row["mode"].startswith("device-side shuffle") and "every layer" not in row["mode"]:
            out["float16, device-side shuffle"] = row["gbps"]
        if row["mode"] == "host gather, pin_memory":
            out["float16, host gather, pin_memory"] = row["gbps"]
    for row in tables.get("float8", {}).get("data", []):
        if row["cache"] == F8 and row["mode"].startswith("device-side shuffle"):
            out["float8_e4m3, device-side shuffle"] = row["gbps"]
    return out


def _targets_section(tables: dict[str, Any], limits: dict[str, float], data: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = []
    advice: list[str] = []
    pread = limits.get("pread")
    for row in tables.get("modes", {}).get("data", []):
        if row["kind"] == "device" and pread:
            r = row["gbps"] / pread
            rows.append([f"page-cached, {row['mode']}", ">= 0.8 of pread", f"{r:.2f}", "yes" if r >= 0.8 else "no"])
            if r < TARGETS["page_cached"]:
                advice.append(f"- {row['mode']} ({r:.2f} of the pread limit): {_advice(row, limits)}")
    for row in tables.get("cold", {}).get("data", []):
        if not row.get("limit"):
            r = row["gbps"] / data.get("cold", {}).get("disk", float("nan"))
            rows.append([f"cold, {row['reader']}", ">= 0.9 of the disk", f"{r:.2f}", "yes" if r >= 0.9 else "no"])
            if r < TARGETS["cold"]:
                advice.append(f"- cold, {row['reader']} ({r:.2f} of the disk): {_advice(row, limits)}")
    for row in tables.get("sae", {}).get("data", []):
        if row["data"] != "already on the device":
            r = row["ratio"]
            rows.append([f"SAE step, {row['data']}", ">= 0.98 of on-device", f"{r:.3f}", "yes" if r >= 0.98 else "no"])
            if r < TARGETS["sae"]:
                have = _loader_alone(tables).get(row["data"])
                advice.append(
                    f"- SAE step fed by {row['data']} ({r:.3f}): "
                    + (
                        "the loader alone is too slow for this step: close its own gap first (above)."
                        if have is not None and have < 1.2 * row["loader_gbps_needed"]
                        else "the loader has the rate but slows the step: keep its Python off the loop's thread "
                        "(fewer, larger calls per batch), give its read threads fewer cores than the node has, and "
                        "check the uploads do not share a copy engine with the step's own traffic."
                    )
                )
    f8 = tables.get("float8", {}).get("data", [])
    for mode in dict.fromkeys(r["mode"] for r in f8):
        by = {r["cache"]: r for r in f8 if r["mode"] == mode}
        if F16 in by and F8 in by:
            r = by[F8]["vectors_per_s"] / by[F16]["vectors_per_s"]
            rows.append(
                [f"float8 / float16 tokens/s, {mode}", "> 1 (half the bytes)", f"{r:.2f}", "yes" if r > 1 else "no"]
            )
            if r <= 1:
                advice.append(f"- float8, {mode} ({r:.2f} x float16): {_advice(by[F8], limits)}")
    if not rows:
        return ["No target could be judged: the parts that measure them did not finish."]
    out = _md_table(["target", "wanted", "measured", "met"], rows)
    out += ["", *(advice or ["Every target measured here is met."])]
    return out


def _advice(row: dict[str, Any], limits: dict[str, float]) -> str:
    """What would close a loader row's gap, by what limits it (`_bottleneck`)."""
    why = _bottleneck(row, limits)
    if "waiting for uploads" in why:
        return (
            why + "; more bytes per copy (larger blocks), or uploads from more than one stream so that both "
            "copy engines work, would raise it up to the read + upload limit."
        )
    if "reading (pread)" in why:
        return (
            why + "; the reads are already the work: bigger requests (block_bytes) or more read threads, up "
            "to the pread limit's best thread count, would close the rest."
        )
    if "per-batch work" in why:
        return (
            why + "; fewer Python calls per batch on that thread (larger batches per call, the index of "
            "several batches prepared at once) would close it."
        )
    if "too few windows" in why:
        return (
            why + "; a third slot (reading the window after next while one uploads and one is gathered) "
            "would keep them busy."
        )
    if "copying each batch" in why:
        return why + "; pin_memory=True (asynchronous copies) or the device-side shuffle would take it off the loop."
    if "window indexes" in why:
        return (
            why + "; computing the index of the window after next earlier, or its permutation on the device, "
            "would take it off the path."
        )
    if "host gather" in why:
        return why + "; only the device-side shuffle takes that work off the CPU."
    return why + "; a profile of this row (ncu and a longer stack sample) is the next step."
