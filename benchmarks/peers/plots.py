"""PNG plots of the peers benchmark's results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.peers import adapters as F
from benchmarks.peers.data import CacheSpec

OURS_COLOUR = "#d62728"
PEER_COLOUR = "#7f7f7f"
#: Line colours for the peers: none of them red, which is ours.
PEER_LINES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#bcbd22"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, rates: dict[str, float], limit: float | None, title: str, limit_label: str, log: bool) -> None:
    keys = list(rates)
    names = [F.FORMATS[k].name for k in keys]
    values = [max(rates[k], 1e-6) if rates[k] == rates[k] else 0.0 for k in keys]
    colours = [OURS_COLOUR if k.startswith("saev") else PEER_COLOUR for k in keys]
    ax.barh(names, values, color=colours)
    ax.invert_yaxis()
    if limit is not None and limit == limit:
        ax.axvline(limit, color="black", linestyle="--", linewidth=1, label=f"{limit_label} {limit:.2f} GB/s")
        ax.legend(loc="lower right", fontsize=7)
    if log:
        ax.set_xscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("GB/s" + (" (log)" if log else ""), fontsize=8)
    ax.tick_params(labelsize=7)


def _loglog_panel(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    """Log-log axes, labels and legend in the grid's small type."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    ax.tick_params(labelsize=7)


def peers(results: dict[str, Any], spec: CacheSpec, out_dir: Path) -> list[Path]:
    """One figure of every workload: results/peers.png."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    slice_kib = f"{spec.slice_nbytes / 1024:.0f} KiB"
    panels = [
        ("slices_page-cached", None, f"1: random {slice_kib} slices, page-cached", "memcpy", True),
        ("slices_cold", None, f"1: random {slice_kib} slices, cold", "O_DIRECT random", True),
        ("pairs", "page-cached", "2: b x 2 layers, page-cached", "memcpy", True),
        ("pairs", "cold", "2: b x 2 layers, cold", "O_DIRECT random", True),
        ("gather", "page-cached", "3: 4096-vector gathers, page-cached", "memcpy", True),
        ("gather", "cold", "3: 4096-vector gathers, cold", "O_DIRECT random", True),
    ]
    for ax, (key, regime, title, limit_label, log) in zip(axes.flat, panels, strict=False):
        res = results.get(key)
        if res is not None and regime is not None:
            res = res.get(regime)
        if not res:
            ax.set_visible(False)
            continue
        _bars(ax, res["gbps"], res["limit"], title, limit_label, log)
    write = results.get("write")
    ax = axes.flat[6]
    if write:
        _bars(ax, write["gbps"], write["limit"], "4: writing the whole cache (fsynced)", "O_DIRECT write", False)
    else:
        ax.set_visible(False)
    ax = axes.flat[7]
    opens = results.get("open")
    if opens:
        peer_colours = iter(PEER_LINES)
        for k, times in opens.items():
            counts = sorted(times)
            ax.plot(
                counts,
                [times[c] * 1e3 for c in counts],
                marker="o",
                label=F.FORMATS[k].name,
                color=OURS_COLOUR if k.startswith("saev") else next(peer_colours),
                linewidth=2.5 if k.startswith("saev") else 1,
            )
        ax.axhline(50, color="black", linestyle="--", linewidth=1, label="target 50 ms")
        _loglog_panel(ax, "shards", "open ms", "5: time to open")
    else:
        ax.set_visible(False)
    ax = axes.flat[8]
    sizes = sorted(results.get("sizes", []), key=lambda r: r["kib"])
    if sizes:
        kib = [r["kib"] for r in sizes]
        for key, label, colour in (
            ("ours", "saev_shards", OURS_COLOUR),
            ("best", "best peer", PEER_LINES[0]),
            ("h5", "HDF5 (h5py)", PEER_LINES[3]),
            ("zarr2", "zarr v2", PEER_LINES[1]),
        ):
            ax.plot(kib, [r[key] for r in sizes], marker="o", label=label, color=colour)
        _loglog_panel(ax, "slice KiB", "GB/s", "1 by slice size, page-cached")
    else:
        ax.set_visible(False)
    fig.suptitle(f"saev_shards (red) against its peers: {spec.describe()}", fontsize=10)
    fig.tight_layout()
    path = out_dir / "peers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def scale(rows: list[dict[str, float]], out_dir: Path) -> Path:
    """Cost per GB against cache size: results/peers_scale.png."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r["gb"] for r in rows]
    for key, label in (("write", "write"), ("rand", "random slices (cold)"), ("seq", "sequential read (cold)")):
        ax.plot(sizes, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("cache GB (log)")
    ax.set_ylabel("seconds per GB")
    ax.set_ylim(bottom=0)
    ax.set_title("saev_shards: cost per GB as the cache grows")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "peers_scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
