"""Commands over run folders: ``run init``, ``run show``, ``doctor``."""

from __future__ import annotations

import argparse
import os
import sys

from .. import store
from ..errors import RunError
from ._common import (
    EXIT_CODES_HELP,
    EXIT_OK,
    EXIT_PROBLEM,
    REF_HELP,
    add_debug,
    add_progress,
    add_roots,
    command,
    plural,
    print_json,
    progress_arg,
    roots_arg,
    table,
)


def cmd_run_init(args: argparse.Namespace) -> int:
    run = store.create_run(
        args.train,
        args.val,
        run_id=args.id,
        runs_root=args.runs_root,
        roots=roots_arg(args),
        train_dataset=args.train_dataset,
        val_dataset=args.val_dataset,
    )
    out = sys.stdout
    out.write(f"created run {run.path}\n")
    caches = {"train": run.open_train(), "val": run.open_val() if os.path.lexists(run.link("val-shards")) else None}
    rows = []
    for name in store.LINK_NAMES:
        link = run.link(name)
        if os.path.lexists(link):
            target = os.readlink(link)
            rows.append((f"links/{name}", f"-> {target}" + ("" if link.exists() else "  (does not exist here)")))
        elif name.endswith("-dataset") and (cache := caches[name.split("-")[0]]) is not None:
            _, why = store.dataset_target(cache.metadata)
            rows.append((f"links/{name}", f"not linked: {why} (pass --{name} PATH to link one)"))
    rows.append(("checkpoint/", "(empty: training writes sae.pt and config.json here)"))
    rows.append(("inference/", "(empty: outputs of the trained SAE, one folder per cache)"))
    table(rows, out, indent="  ")
    return EXIT_OK


def cmd_run_show(args: argparse.Namespace) -> int:
    run = store.open_run(args.run, args.runs_root)
    paths: dict[str, str | None] = {"run": str(run.path)}
    for name in store.LINK_NAMES:
        try:
            paths[name] = str(run.target(name))
        except RunError:
            paths[name] = None
    paths["sae_checkpoint"] = str(run.sae_checkpoint)
    paths["checkpoint_config"] = str(run.checkpoint_config)
    if args.json:
        print_json(paths, sys.stdout)
    else:
        table(
            [(k, v if v is not None else "- (missing or dangling; see: saev-shards doctor)") for k, v in paths.items()],
            sys.stdout,
        )
    return EXIT_OK


_MARK = {"ok": "ok", "note": "note", "warning": "WARNING", "error": "ERROR"}


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.run is None:
        findings = store.doctor_environment(roots_arg(args), args.runs_root)
        title = "environment"
    else:
        run = store.open_run(args.run, args.runs_root)
        findings = store.doctor(run, verify=args.verify, require_checkpoint=args.trained, progress=progress_arg(args))
        title = f"run {run.path}"
    errors = sum(f.level == "error" for f in findings)
    warnings_ = sum(f.level == "warning" for f in findings)
    if args.json:
        print_json(
            {
                "subject": title,
                "errors": errors,
                "warnings": warnings_,
                "findings": [{"level": f.level, "subject": f.subject, "message": f.message} for f in findings],
            },
            sys.stdout,
        )
    else:
        out = sys.stdout
        out.write(f"{title}\n")
        table([(_MARK[f.level], f.subject, f.message) for f in findings], out, indent="  ")
        out.write(f"{plural(errors, 'error')}, {plural(warnings_, 'warning')}\n")
    return EXIT_PROBLEM if errors else EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add this module's commands to the ``saev-shards`` parser."""
    run_parser = sub.add_parser(
        "run",
        help="create a run folder, or show the paths a run resolves to",
        description="Run folders: <runs root>/<run_id>/ with links/ and checkpoint/.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  saev-shards run init --train 3f2a --val 9c1d --id sae-16k\n"
        "  saev-shards run show --run sae-16k\n\n" + EXIT_CODES_HELP,
    )
    add_debug(run_parser)
    run_sub = run_parser.add_subparsers(dest="run_command", metavar="<run command>", required=True)
    p = command(
        run_sub,
        "init",
        "create <runs root>/<id>/ with links/{train,val}-{shards,dataset}, checkpoint/ and inference/",
        "  saev-shards run init --train 3f2a --val 9c1d --id sae-16k\n"
        "  saev-shards run init --train 3f2a --train-dataset /data/imagenet/train --runs-root ./runs\n",
        cmd_run_init,
        description=(
            "Create <runs root>/<id>/ with checkpoint/, inference/ and links/train-shards, links/val-shards (the "
            "caches, resolved from paths, hashes or prefixes) and links/train-dataset, links/val-dataset (default: "
            "the dataset recorded in each cache's metadata, when it is a path that exists here; a dataset recorded "
            "as a name, such as python-stdlib-3.11.7, gets no link). A val cache that is the train cache, or "
            "differs from it in model, layers, width, tokens or dtype, is a warning."
        ),
    )
    p.add_argument("--train", required=True, metavar="REF", help="training cache: " + REF_HELP)
    p.add_argument("--val", metavar="REF", help="validation cache (optional)")
    p.add_argument("--id", metavar="RUN_ID", help="run id (default: <date>-<time>-<train hash[:8]>)")
    p.add_argument(
        "--train-dataset", metavar="PATH", help="the dataset (default: the train cache's, if a path that exists here)"
    )
    p.add_argument(
        "--val-dataset", metavar="PATH", help="the dataset (default: the val cache's, if a path that exists here)"
    )
    p.add_argument("--runs-root", metavar="DIR", help="runs root (default: $SAEV_RUNS_ROOT, else $SAEV_NFS/saev/runs)")
    add_roots(p)

    p = command(
        run_sub,
        "show",
        "print every path a run resolves to (links followed, checkpoint files)",
        "  saev-shards run show --run sae-16k\n  saev-shards run show --run /nfs/me/saev/runs/sae-16k --json\n",
        cmd_run_show,
    )
    p.add_argument("--run", required=True, metavar="RUN", help="run folder path, or a run id in the runs root")
    p.add_argument("--runs-root", metavar="DIR", help="runs root for bare run ids")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = command(
        sub,
        "doctor",
        "check a run's links and files (or, without --run, the roots); exit 1 on any error",
        "  saev-shards doctor --run sae-16k\n"
        "  saev-shards doctor --run /nfs/me/saev/runs/sae-16k --verify --trained\n"
        "  saev-shards doctor                      # which roots are configured, and do they exist\n",
        cmd_doctor,
        description=(
            "Check a run folder: every link under links/ (missing, dangling, not a symlink, a cache that does "
            "not open or, with --verify, fails its checksums), checkpoint/ and its files, and that the train "
            "and val caches agree on model, layers and width. Without --run, check the configured roots."
        ),
    )
    p.add_argument("--run", metavar="RUN", help="run folder path, or a run id in the runs root")
    p.add_argument("--runs-root", metavar="DIR", help="runs root (default: $SAEV_RUNS_ROOT, else $SAEV_NFS/saev/runs)")
    p.add_argument("--verify", action="store_true", help="also verify the checksums of the linked caches")
    p.add_argument("--trained", action="store_true", help="require checkpoint/sae.pt and checkpoint/config.json")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_roots(p)
    add_progress(p)
