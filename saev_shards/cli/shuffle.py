"""``saev-shards shuffle``: a perfectly shuffled copy of a cache's chosen tokens (`saev_shards.shuffle`)."""

from __future__ import annotations

import argparse
import sys
import time

from .. import store, world
from ..errors import CommandError, DiskFullError, ShuffleError
from ..humanize import human_bytes
from ..protocol.common import DTYPES
from ..selection import TOKEN_CHOICES
from ..shuffle import DEFAULT_MEMORY, plan_shuffle, run_plan, run_rank
from ..shuffle.meeting import DEFAULT_WAIT, torch_group_from_env
from ._common import (
    EXIT_OK,
    EXIT_SYSTEM,
    EXIT_USAGE,
    REF_HELP,
    add_progress,
    add_roots,
    command,
    int_list,
    parse_size,
    progress_arg,
    roots_arg,
)


def parse_seconds(text: str) -> float:
    """``"600"`` or ``"2.5"`` -> seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, found {text!r}")
    return value


def cmd_shuffle(args: argparse.Namespace) -> int:
    source = store.open_cache(args.ref, roots=roots_arg(args))
    layers = [v for group in args.layers for v in group] if args.layers else None
    try:
        plan = plan_shuffle(
            source,
            args.to,
            layers=layers,
            tokens=args.tokens,
            seed=args.seed,
            dtype=args.dtype,
            patches_per_shard=args.patches_per_shard,
            memory_bytes=args.memory,
            workers=args.workers,
            work_dir=args.work_dir,
            allow_nonfinite=args.allow_nonfinite,
            exclude_token_ids=[v for group in args.exclude_token_ids for v in group] if args.exclude_token_ids else (),
            max_norm_multiple=args.max_norm_multiple,
            progress=args.progress,
        )
    except ShuffleError as error:  # the arguments do not fit this source: a usage error
        raise CommandError(EXIT_USAGE, str(error)) from error
    err = sys.stderr
    if args.dry_run:
        sys.stdout.write("\n".join(plan.describe()) + "\n")
        return EXIT_OK
    if plan.path.exists():
        run_plan(plan)  # returns at once (removing what a run killed after publishing left)
        err.write(f"{plan.output.hash[:12]}: already shuffled, nothing to do\n")
        sys.stdout.write(f"{plan.path}\n")
        return EXIT_OK
    found = world.detect(args.rank, args.world_size, slurm_array=True, error=ShuffleError)
    rank, world_size = found.rank, found.world_size
    if rank == 0:
        err.write("\n".join(plan.describe()) + "\n")
    start = time.perf_counter()
    try:
        if world_size > 1:

            def waiting(text: str) -> None:
                err.write(f"rank {rank}: {text}\n")

            # Under torchrun the ranks meet through a gloo process group; otherwise through files.
            with torch_group_from_env(found, args.wait):
                done = run_rank(plan, rank, world_size, progress=progress_arg(args), on_wait=waiting, wait=args.wait)
            if done is None:
                err.write(f"rank {rank} of {world_size}: its share is written; rank 0 publishes\n")
                return EXIT_OK
            shuffled = done
        else:
            shuffled = run_plan(plan, progress=progress_arg(args))
    except DiskFullError as error:
        raise CommandError(EXIT_SYSTEM, str(error)) from error
    seconds = time.perf_counter() - start
    nbytes = shuffled.metadata.nbytes + shuffled.metadata.scales_nbytes
    err.write(
        f"{plan.output.hash[:12]}: shuffled {plan.n_tokens:,} tokens ({human_bytes(nbytes)}) in {seconds:.1f} s, "
        f"{human_bytes(nbytes / max(seconds, 1e-9))}/s\n"
    )
    sys.stdout.write(f"{shuffled.path}\n")
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add ``shuffle`` to the ``saev-shards`` parser."""
    p = command(
        sub,
        "shuffle",
        "write a cache's chosen tokens in a uniformly random order as a new cache (read it in order to train)",
        "  saev-shards shuffle 3f2a --layers 11                 # content tokens of layer 11, seed 0\n"
        "  saev-shards shuffle 3f2a --layers 6,11 --tokens all --seed 1 --dtype bfloat16\n"
        "  saev-shards shuffle 3f2a --layers 11 --memory 16G --workers 4 --work-dir /local/ssd\n"
        "  saev-shards shuffle 3f2a --layers 11 --dry-run        # the plan: sizes, buckets, memory, scratch\n"
        "  SHUFFLED=$(saev-shards shuffle 3f2a --layers 11)     # stdout is only the new cache's path\n"
        "  saev-shards shuffle 3f2a --layers 11 --rank 1 --world-size 4 --to /shared/shards   # one of 4 machines\n",
        cmd_shuffle,
        description=(
            "Write the chosen tokens of a cache, in a uniformly random order, as a new cache with one token per "
            "example (T = 1) at every chosen layer, plus columns source_example and source_token (and labels, "
            "per-token columns) saying where each row came from. Reading it in order gives a perfectly shuffled "
            "epoch at sequential speed. Two passes with bounded memory (--memory): the source is read once and "
            "scattered into buckets on disk (--work-dir, about the output's size), then each bucket is sorted in "
            "memory and appended. The order depends only on the source, the selection and --seed. Interrupted? "
            "Run the same command again: it resumes. The new cache's path goes to stdout, the plan and a summary "
            "to stderr; the output goes next to the source unless --to says otherwise. Across machines: start "
            "every rank with the same arguments, --rank R --world-size W (or RANK/WORLD_SIZE, or a SLURM array), "
            "and --to and --work-dir on a filesystem they share: each scatters its share of the source and writes "
            "its share of the output; rank 0 publishes; the bytes are those of a one-process shuffle."
        ),
    )
    p.set_defaults(interrupted_hint="the runs written so far are kept: run the same command again to resume")
    p.add_argument("ref", metavar="SRC", help=REF_HELP)
    _add_selection(p)
    p.add_argument("--seed", type=int, default=0, help="decides the order (default: 0)")
    p.add_argument("--dtype", choices=list(DTYPES), help="stored dtype of the output (default: the source's)")
    p.add_argument("--to", metavar="DIR", help="shards root to publish the output in (default: the source's folder)")
    p.add_argument(
        "--memory",
        type=parse_size,
        metavar="SIZE",
        help=f"memory budget of all processes together, e.g. 2G, 512M (default: {DEFAULT_MEMORY >> 30}G, or half "
        "the memory limit of this process's cgroup where that is lower)",
    )
    p.add_argument("--workers", type=int, default=1, metavar="N", help="processes sharing the work (default: 1)")
    p.add_argument("--work-dir", metavar="DIR", help="where the scratch runs go (default: the output's root)")
    p.add_argument(
        "--patches-per-shard", type=int, metavar="N", help="shard budget of the output (default: the source's)"
    )
    p.add_argument("--allow-nonfinite", action="store_true", help="store inf/NaN values instead of stopping")
    _add_ranks(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    add_roots(p)
    add_progress(p)


def _add_selection(p: argparse.ArgumentParser) -> None:
    """The token selection (`saev_shards.selection.SelectionSpec`): layers, tokens, the token masks."""
    p.add_argument(
        "--layers",
        type=int_list,
        action="append",
        metavar="L[,L...]",
        help="layer values to keep (default: every recorded layer; repeatable)",
    )
    p.add_argument("--tokens", choices=TOKEN_CHOICES, default="content", help="which tokens (default: content)")
    p.add_argument(
        "--exclude-token-ids",
        type=int_list,
        action="append",
        metavar="ID[,ID...]",
        help="leave out positions whose token_ids value is listed, e.g. BOS and padding (repeatable)",
    )
    p.add_argument(
        "--max-norm-multiple",
        type=float,
        metavar="K",
        help="leave out positions whose vector at a chosen layer has a norm above K times its layer's median norm",
    )


def _add_ranks(p: argparse.ArgumentParser) -> None:
    """Several processes or machines sharing one shuffle."""
    p.add_argument(
        "--rank",
        type=int,
        help="this process's rank when several share one shuffle (default: RANK or SLURM_ARRAY_TASK_ID, else 0)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        help="processes sharing one shuffle over a shared --work-dir and --to (default: WORLD_SIZE or "
        "SLURM_ARRAY_TASK_COUNT, else 1); rank 0 publishes",
    )
    p.add_argument(
        "--wait",
        type=parse_seconds,
        default=DEFAULT_WAIT,
        metavar="SECONDS",
        help=f"with several ranks: how long a rank waits for the others without progress before it gives up, naming "
        f"the missing ranks (default: {DEFAULT_WAIT:g}; under torchrun, at each meeting point)",
    )
