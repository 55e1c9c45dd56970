"""``saev-shards dump``: the command line of `saev_shards.dump` (imported only when run: it loads models).

Errors map to exit codes in `saev_shards.cli` like every other command's: a bad
configuration (`ConfigError`, no root) is 2, a busy writer or a full disk 4, a failing
model or non-finite values 1, and Ctrl-C 130 with one line saying the sealed shards are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from pathlib import Path
from types import ModuleType

from ..errors import CommandError
from ._common import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, add_progress, command

#: The smallest configuration, shown by ``saev-shards dump --help``; docs/dump.md has them all.
MINIMAL_CONFIG = """\
  layers = [1, 3]                   # block indices to record
  T = 64                            # tokens per example (truncate or pad)
  model = "/models/bert-base"       # a local Hugging Face folder (never downloaded)
  dataset = "texts.jsonl"           # one {"text": ...} per line; or "stdlib", or lines.txt
  # root = "/scratch/me/saev/shards"  default: $SAEV_SHARDS_ROOT, else $SAEV_SCRATCH/saev/shards
"""

INTERRUPTED_HINT = "sealed shards are kept: run the same command again to resume"


def _module() -> ModuleType:
    try:
        return importlib.import_module("saev_shards.dump")
    except ImportError as err:
        if err.name in ("saev_shards.dump", "saev_shards"):
            message = "the dump command is not available in this installation (no module saev_shards.dump)"
        else:
            message = f"the dump command needs {err.name or 'a package'}, which is not installed ({err})"
        raise CommandError(EXIT_USAGE, message) from err


def cmd_dump(args: argparse.Namespace) -> int:
    dump = _module()
    cfg = dump.load_config(args.config)
    if args.device:
        cfg = dataclasses.replace(cfg, device=args.device)
    root = dump.output_root(cfg, args.root)
    from ..writer import world_from_env

    rank, world_size = world_from_env(args.rank, args.world_size)
    if args.dry_run:
        print(dump.describe(dump.plan(cfg, weights=False), root, rank, world_size))
        return EXIT_OK
    if args.finalize:
        md = dump.plan(cfg, weights=False).metadata
        final = root.path / md.hash
        if final.exists():
            print(f"already published: {final}")
        else:
            from ..writer import finalize

            print(f"published {finalize(root.path, md)}")
        print(final)  # the path alone, last, as every command that makes a cache prints it
        return EXIT_OK
    path = dump.dump(
        cfg,
        root=root.path,
        rank=rank,
        world_size=world_size,
        restart=args.restart,
        finalize_when_done=not args.no_finalize,
        progress=args.progress,
        check_space=not args.no_space_check,
    )
    if path is not None:
        print(path, flush=True)  # the path alone, last, as every command that makes a cache prints it
    return EXIT_OK if path is not None or world_size > 1 else EXIT_PROBLEM


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add ``dump`` (its module, which needs torch, loads only when ``dump`` runs)."""
    p = command(
        sub,
        "dump",
        "record a model's activations into a new cache (needs torch; configuration: docs/dump.md)",
        "  saev-shards dump dump.toml --dry-run     # the hash, where the cache goes, shards and bytes\n"
        "  saev-shards dump dump.toml               # dump; run it again after an interruption to resume\n"
        "  saev-shards dump dump.toml --rank 3 --world-size 16   # one of 16 writers\n"
        "  torchrun --nproc-per-node 8 -m saev_shards.dump dump.toml\n\n"
        "a minimal dump.toml (every key, and what a dump writes: docs/dump.md):\n" + MINIMAL_CONFIG,
        cmd_dump,
        description=(
            "Run a model over a text corpus and record the residual stream of chosen blocks into a cache. "
            "The configuration is checked against the model before anything is written; an interrupted dump "
            "resumes after its last sealed shard when run again; several writers split the shards."
        ),
    )
    p.set_defaults(interrupted_hint=INTERRUPTED_HINT)
    p.add_argument("config", type=Path, help="dump configuration (.toml or .json)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the hash, where the cache goes, shards and bytes; do nothing"
    )
    p.add_argument(
        "--root",
        type=Path,
        metavar="DIR",
        help="folder of caches (default: the config's root, else $SAEV_SHARDS_ROOT, else $SAEV_SCRATCH/saev/shards)",
    )
    p.add_argument("--rank", type=int, help="this writer's rank (default: RANK or SLURM_ARRAY_TASK_ID, else 0)")
    p.add_argument("--world-size", type=int, help="number of writers (default: WORLD_SIZE or the SLURM count)")
    p.add_argument("--restart", action="store_true", help="discard this writer's sealed shards and start over")
    p.add_argument("--no-finalize", action="store_true", help="never publish from this writer (run --finalize later)")
    p.add_argument("--finalize", action="store_true", help="only check every shard, write the manifest and publish")
    p.add_argument("--device", help="override the config's device (auto, cpu, cuda, cuda:1, ...)")
    p.add_argument(
        "--no-space-check",
        action="store_true",
        help="start even if the free space under the root looks too small for this writer's share "
        "(also SAEV_SHARDS_NO_SPACE_CHECK=1)",
    )
    add_progress(p)
