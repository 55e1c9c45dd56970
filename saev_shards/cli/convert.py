"""``saev-shards convert SRC``: bring a cache in from another format (`saev_shards.convert`).

Standard output says what the source is and how it is mapped, then, as its last line, the
published cache's path (``path=$(saev-shards convert src | tail -1)``); the progress bar,
warnings and what could not be carried over go to standard error.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..convert import SOURCES, TARGETS, Options, Prepared, Result, prepare, run
from ..humanize import human_bytes
from ..progress import Progress
from ..protocol.common import DTYPES_BY_PROTOCOL, PROTOCOL, PROTOCOL_30
from ._common import EXIT_OK, add_progress, command, int_list, parse_size, plural, warn

EXAMPLES = """\
  saev-shards convert ./activations                 # pickle shards (metadata.json + shard_0001.pkl.gz)
  saev-shards convert run/activations.zarr          # a zarr activation log (or a run folder with shards/)
  saev-shards convert ./saelens_cache --max-tokens 64   # a SAELens cache_activations folder
  saev-shards convert acts.npy --layers 6,11 --family clip --ckpt ViT-B-16/openai
  saev-shards convert ./activations --dry-run       # what would be written, and its hash
  path=$(saev-shards convert ./activations | tail -1)
  saev-shards convert $SAEV_SCRATCH/saev/shards/e2f8cd3a          # a cache saev wrote -> protocol 3.1
  saev-shards convert 3f2a9c... --dtype float8_e4m3       # a cache at one byte per value (and back: --dtype float16)
  saev-shards convert 3f2a9c... --to saev --root $SAEV_SCRATCH/saev/shards   # -> a cache saev reads as its own
"""

DESCRIPTION = """\
Convert activations from another format into a cache: the source kind is detected (or
named with --from), the source is streamed one shard or chunk at a time, its checksums
are verified before its data is used, and the cache is published atomically. Killed
midway, the same command resumes after the last sealed shard and publishes the same bytes.
The last line of standard output is the published cache's path.

source kinds:
""" + "\n".join(f"  {k.name:<8} {k.summary}" for k in SOURCES.values())


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return value


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    p = command(
        sub,
        "convert",
        "convert activations from another format (pickle shards, zarr logs, SAELens, .npy) or another "
        "cache into a cache (--to 3.1, 3.0, or saev for saev's own loaders)",
        EXAMPLES,
        cmd_convert,
        description=DESCRIPTION,
    )
    p.set_defaults(interrupted_hint="the sealed shards are kept: run the same command again to resume")
    p.add_argument("src", help="the source: a folder or file")
    p.add_argument("--from", dest="kind", choices=list(SOURCES), help="source kind (default: detected)")
    p.add_argument(
        "--to",
        default=PROTOCOL,
        choices=list(TARGETS),
        help=f"what to write: {PROTOCOL} (this library's caches, the default), {PROTOCOL_30} (for readers that "
        "know no later version) or saev (protocol 2.1 as saev's code writes it, float32: activations and labels only)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES_BY_PROTOCOL[PROTOCOL]),
        help="stored dtype (default: float16; a cache source keeps its own; saev: float32); float8_e4m3: one byte "
        "per value and a float32 scale per vector (protocol 3.1)",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        help="shards root to publish in (default: $SAEV_SHARDS_ROOT, else $SAEV_SCRATCH/saev/shards)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive,
        metavar="N",
        help="keep at most N token positions per example (longer ones are truncated and counted)",
    )
    p.add_argument(
        "--layers",
        type=int_list,
        metavar="L1,L2",
        help="layer numbers of the stored layers, in order (npy, zarr, SAELens)",
    )
    p.add_argument("--cls-token", action="store_true", help="token 0 of every example is a [CLS] token")
    p.add_argument("--family", help="model family to record (default: from the source, else 'unknown')")
    p.add_argument("--ckpt", help="model checkpoint to record (default: from the source, else 'unknown')")
    p.add_argument(
        "--patches-per-shard", type=_positive, metavar="N", help="shard budget in token vectors (default 2,400,000)"
    )
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="store values that are inf or NaN after the cast instead of failing",
    )
    p.add_argument(
        "--max-memory",
        type=parse_size,
        metavar="SIZE",
        help="memory the source's data may take at once, e.g. 16G (default: half the machine's memory); a pickle "
        "shard may expand to a quarter of it, a zarr chunk to half; larger ones are refused before they are read",
    )
    p.add_argument(
        "--no-space-check",
        action="store_true",
        help="write even if the free space under the root looks too small (e.g. a compressing filesystem)",
    )
    p.add_argument("--no-stats", dest="stats", action="store_false", help="skip per-layer statistics (stats.json)")
    p.add_argument("--restart", action="store_true", help="discard sealed shards of an interrupted run and start over")
    p.add_argument(
        "--dry-run", action="store_true", help="plan only: print the mapping, the shape and the hash; write nothing"
    )
    add_progress(p)


def cmd_convert(args: argparse.Namespace) -> int:
    out = sys.stdout
    prepared = _prepare(args)
    plan = prepared.plan
    _describe(prepared, out)
    if args.dry_run:
        for note in plan.notes:
            warn(note)  # each says what was dropped or changed
        state = "published" if prepared.path.exists() else "not written (dry run)"
        out.write(f"{state}: {prepared.path}\n")
        return EXIT_OK

    def say(message: str) -> None:
        out.write(message + "\n")
        out.flush()

    result = run(
        prepared,
        allow_nonfinite=args.allow_nonfinite,
        stats=args.stats,
        restart=args.restart,
        progress=args.progress,
        log=say,
        check_space=not args.no_space_check,
    )
    _summary(result, out)
    return EXIT_OK


def _prepare(args: argparse.Namespace) -> Prepared:
    """The conversion planned from the command line (a progress bar while a source is scanned)."""
    options = Options(
        max_tokens=args.max_tokens,
        layers=args.layers,
        cls_token=args.cls_token,
        family=args.family,
        ckpt=args.ckpt,
        memory_bytes=args.max_memory,
    )
    bar: list[Progress] = []

    def scan(k: int, total: int) -> None:
        if not bar:
            bar.append(
                Progress(
                    total - 1, "scan (longest sequence; --max-tokens skips this)", unit="shards", enabled=args.progress
                )
            )
        bar[0].update(1)

    try:
        return prepare(
            args.src,
            kind=args.kind,
            to=args.to,
            root=args.root,
            dtype=args.dtype,
            patches_per_shard=args.patches_per_shard,
            options=options,
            scan=scan,
        )
    finally:
        if bar:
            bar[0].close()


def _describe(prepared: Prepared, out: TextIO) -> None:
    """What the source is and how it is mapped, one ``key  value`` line each."""
    plan, md = prepared.plan, prepared.metadata
    n, n_layers, tokens, d_model = md.shape
    lines = [
        ("source", f"{prepared.kind.name}: {plan.path} ({human_bytes(plan.source_nbytes)})"),
        ("model", f"{md.family} {md.ckpt}"),
        *(("mapping", line) for line in plan.layout),
        ("checksums", plan.checksums),
        (
            "cache",
            f"{md.hash[:12]} ({n:,}, {n_layers}, {tokens}, {d_model}) {md.dtype}, {plural(md.n_shards, 'shard')}, "
            f"{human_bytes(md.nbytes + md.scales_nbytes)} of activations, protocol {md.protocol}",
        ),
    ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        out.write(f"{key:<{width}}  {value}\n")
    out.flush()


def _summary(result: Result, out: TextIO) -> None:
    """What was not carried over (stderr), how long it took, and the cache's path as the last line."""
    md = result.metadata
    for line in result.report.lines():
        warn(line)
    if result.already_published:
        out.write("already published\n")
    else:
        rate = result.examples_written * md.example_nbytes / max(result.seconds, 1e-9)
        out.write(
            f"converted {result.examples_written:,} examples in {result.seconds:.1f} s "
            f"({human_bytes(rate)}/s of activations written)\n"
        )
    out.write(f"{result.path}\n")
