"""Commands that copy a cache, verified: ``stage`` (to local disk), ``push`` (to a remote shards
root) and ``pull`` (from one). ``stage`` and ``pull`` are one operation (`store.copy_cache`)
and say what they did in one summary (`say_copied`)."""

from __future__ import annotations

import argparse
import sys

from .. import store
from ..humanize import human_bytes
from ._common import EXIT_OK, REF_HELP, add_progress, add_roots, command, plural, progress_arg, roots_arg


def say_copied(report: store.TransferReport, verb: str, already: str) -> None:
    """The summary of a verified local copy on stderr (``verb``: "copied"; ``already``: "already
    staged"), then its path on stdout, once it is known to open."""
    name = report.path.name[:12]
    if report.already_there:
        sys.stderr.write(f"{name}: {already}, nothing {verb}\n")
    else:
        done = [f"{verb} {report.copied_files} files ({human_bytes(report.copied_bytes)})"]
        if report.kept_files or report.resumed_files:
            done.append(
                f"resumed: kept {report.kept_files} complete and {report.resumed_files} half-written files "
                f"({human_bytes(report.kept_bytes)}) after re-verifying them"
            )
        if report.recopied:
            done.append(f"re-copied {len(report.recopied)} that failed verification ({', '.join(report.recopied)})")
        if report.repaired:
            done.append("repaired a damaged local copy")
        checked = "checksums verified" if not report.unverified else f"{len(report.unverified)} files had no checksum"
        sys.stderr.write(f"{name}: " + "; ".join(done) + f"; {checked}\n")
    store.open_quietly(report.path)  # what the caller gets is a cache that opens
    sys.stdout.write(f"{report.path}\n")


def _copy_options(args: argparse.Namespace) -> store.CopyOptions:
    return store.CopyOptions(roots=roots_arg(args), progress=progress_arg(args), check_space=not args.no_space_check)


def cmd_stage(args: argparse.Namespace) -> int:
    say_copied(store.copy_cache(args.ref, args.to, options=_copy_options(args)), "copied", "already staged")
    return EXIT_OK


def cmd_pull(args: argparse.Namespace) -> int:
    say_copied(store.pull(args.url, args.to, options=_copy_options(args)), "downloaded", "already here")
    return EXIT_OK


def cmd_push(args: argparse.Namespace) -> int:
    report = store.push(
        args.ref, args.root_url, roots=roots_arg(args), verify=not args.no_verify, progress=progress_arg(args)
    )
    err = sys.stderr
    name = report.url.rsplit("/", 1)[-1][:12]
    if report.already_there:
        err.write(f"{name}: already pushed, nothing uploaded\n")
    else:
        done = f"uploaded {plural(report.copied_files, 'file')} ({human_bytes(report.copied_bytes)})"
        if report.kept_files:
            done += f"; kept {report.kept_files} already there ({human_bytes(report.kept_bytes)}, checked)"
        if report.recopied:
            done += f"; replaced {len(report.recopied)} that held other bytes ({', '.join(report.recopied[:5])})"
        err.write(f"{name}: {done}; metadata.json and shards.json written last\n")
    if report.verified_bytes:
        err.write(f"{name}: read back {human_bytes(report.verified_bytes)} from the server: every digest matches\n")
    else:
        err.write(f"{name}: sizes checked (--no-verify: `saev-shards verify {report.url}` reads it all back)\n")
    sys.stdout.write(f"{report.url}\n")
    return EXIT_OK


def _add_space_check(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--no-space-check",
        action="store_true",
        help=f"{what} even if the free space at the destination looks too small (also SAEV_SHARDS_NO_SPACE_CHECK=1)",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], invoked: str | None) -> None:
    """Add this module's commands to the ``saev-shards`` parser."""
    p = command(
        sub,
        "stage",
        "copy a cache to local disk with checksums verified, atomically and resumably; print the copy's path",
        "  saev-shards stage 3f2a                      # to $SAEV_STAGE_ROOT or $TMPDIR/saev/shards\n"
        "  saev-shards stage 3f2a --to /local/ssd/saev/shards\n"
        "  SHARDS=$(saev-shards stage 3f2a)           # stdout is only the local path\n",
        cmd_stage,
        description=(
            "Copy a cache to local disk: files go to <dest>/.copying-<hash>/ and are hashed while written; "
            "only when every size and xxh3_128 checksum matches the source manifest is the copy made read-only "
            "and renamed to <dest>/<hash>. Interrupted? Run the same command again: complete files are "
            "re-verified and kept, a half-written one is completed. A local copy damaged since (a scratch "
            "purge) is repaired. Prints the local path on stdout, a summary on stderr."
        ),
    )
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("--to", metavar="DIR", help="destination root (default: $SAEV_STAGE_ROOT, else $TMPDIR/saev/shards)")
    _add_space_check(p, "copy")
    p.set_defaults(interrupted_hint="what was copied is kept: run the same command again to resume")
    add_roots(p)
    add_progress(p)

    p = command(
        sub,
        "push",
        "publish a cache in an object store as ROOT_URL/<hash>: uploaded, verified, shards.json last",
        "  saev-shards push 3f2a s3://my-bucket/saev/shards\n"
        "  AWS_ENDPOINT_URL=http://localhost:9000 saev-shards push 3f2a s3://local/shards   # MinIO\n"
        "  URL=$(saev-shards push 3f2a s3://my-bucket/saev/shards)   # stdout is only the URL\n",
        cmd_push,
        description=(
            "Upload a local cache to a remote shards root (s3://, gs://, az://) as ROOT_URL/<hash>: the data "
            "files first (several at once, each a multipart upload, hashed while read so damaged local bytes are "
            "never published), then metadata.json, and shards.json last: until then no reader sees a cache there. "
            "Interrupted? Run it again: files already uploaded are read back and kept when they match, uploaded "
            "again when they do not (so a push repairs a damaged remote copy). Before shards.json, every file "
            "uploaded is read back and checked (--no-verify: sizes only). Credentials, region and endpoint come "
            "from the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_REGION, AWS_ENDPOINT_URL, AWS_PROFILE). "
            "Prints the URL last."
        ),
    )
    p.add_argument("ref", help=REF_HELP)
    p.add_argument("root_url", metavar="ROOT_URL", help="remote shards root, e.g. s3://bucket/saev/shards")
    p.add_argument("--no-verify", action="store_true", help="check sizes only instead of reading everything back")
    p.set_defaults(interrupted_hint="uploaded files are kept: run the same command again to resume")
    add_roots(p)
    add_progress(p)

    p = command(
        sub,
        "pull",
        "copy a remote cache into the shards root with every checksum verified (like stage); print its path",
        "  saev-shards pull s3://my-bucket/saev/shards/3f2a\n"
        "  saev-shards pull 3f2a --root s3://my-bucket/saev/shards --to /local/ssd/saev/shards\n",
        cmd_pull,
        description=(
            "Download a remote cache (its URL, a hash prefix in it, or a hash found in a remote --root) into "
            "<dest>/.copying-<hash>/, every file checked against the manifest, then renamed to <dest>/<hash>. "
            "Interrupted? Run it again: what was downloaded is re-verified and kept. Default destination: the "
            "first local shards root."
        ),
    )
    p.add_argument(
        "url", metavar="URL", help="a remote cache: s3://bucket/root/<hash or prefix>, or a hash with --root URL"
    )
    p.add_argument("--to", metavar="DIR", help="destination root (default: the first local shards root)")
    _add_space_check(p, "download")
    p.set_defaults(interrupted_hint="what was downloaded is kept: run the same command again to resume")
    add_roots(p)
    add_progress(p)
