"""`cachefs warmup`: parse, find the mount, send one control request, show its progress.

Registered as a `cachefs` subcommand through the ``cachefs.commands`` entry point.
"""

import argparse
import json
import signal
import sys

from cachefs.control.client import hello, request
from cachefs.errors import CachefsError, ExitCode, PermissionDenied, Unsupported, UsageError, exit_codes_help
from cachefs.warm.walk import list_through

from .locate import Target, locate, one_mount
from .manifest import read_manifest
from .progress import ProgressBar, check_report, listing_line, summary


class WarmupExit:
    """Exit codes of `cachefs warmup` beside the common ones (2 usage, 5 store, 9 no daemon)."""

    FAILED = 11         # some objects could not be warmed (listed in the summary)
    REFUSED = 12        # the dataset does not fit the free cache (use --force)
    INTERRUPTED = 130   # Ctrl-C: rerun to fetch only what is missing


EXIT_CODES = exit_codes_help([0, 2, 5, 9, WarmupExit.FAILED, WarmupExit.REFUSED, 13, 14, WarmupExit.INTERRUPTED])

_UPLOAD_CHUNK = 512 << 10


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "warmup", help="fill a mount's cache with a dataset before a training run",
        description="Warm a dataset into the disk tier of the cachefs mount that serves it. DATASET is a "
        "file or directory in a mount, a glob (quote it), or an s3://bucket/prefix URL served by a mount "
        "on this node.", epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("datasets", nargs="*", metavar="DATASET")
    p.add_argument("--manifest", metavar="FILE", help="paths to warm: one per line, or a CSV/Parquet file with "
                   "a path column; relative paths are under DATASET (or the current directory)")
    p.add_argument("--column", help="the manifest's path column (default: path, file, filename, key)")
    p.add_argument("--concurrency", type=int, default=32, help="parallel GETs (default 32)")
    p.add_argument("--bandwidth-limit", metavar="RATE", help="most bytes per second fetched, e.g. 200M")
    p.add_argument("--force", action="store_true", help="warm as much as fits even if the dataset is "
                   "larger than the free cache")
    p.add_argument("--pin", action="store_true", help="keep the warmed dataset from eviction until --unpin")
    p.add_argument("--unpin", action="store_true", help="drop a --pin (fetches nothing)")
    p.add_argument("--check", action="store_true", help="report how much is cached, per tier (fetches nothing)")
    p.add_argument("--evict", action="store_true", help="drop the dataset from the cache (and its pin)")
    p.add_argument("--detach", action="store_true", help="start the warmup in the daemon and return")
    p.add_argument("--no-list", dest="list_after", action="store_false",
                   help="do not list the warmed dataset through the mount afterwards (on --immutable mounts "
                   "it is, so that a first epoch that opens files by name sends no lookup)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary")
    p.add_argument("--json", action="store_true", help="progress and summary as JSON lines on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if sum((args.check, args.evict, args.unpin)) > 1:
        raise UsageError("use one of --check, --evict, --unpin")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")
    command = "warmup_check" if args.check else "warmup_evict" if args.evict else \
        "warmup_unpin" if args.unpin else "warmup"
    mountpoint, payload, walk = _payload(args, command)
    if args.check:
        return _simple(mountpoint, command, payload, args, lambda r: check_report(payload["label"], r))
    if args.evict:
        return _simple(mountpoint, command, payload, args, lambda r: (
            f"evicted {r['blocks']} blocks ({r['bytes']} bytes) of {r['files']} files of {payload['label']}"
            + ("; unpinned" if r["unpinned"] else "")))
    if args.unpin:
        return _simple(mountpoint, command, payload, args, lambda r: (
            f"unpinned {payload['label']}" if r["unpinned"] else f"{payload['label']} was not pinned"))
    from cachefs.config import parse_size  # only here: the config module is slow to import

    payload.update(concurrency=args.concurrency, force=args.force, pin=args.pin, detach=args.detach,
                   bandwidth_limit=parse_size(args.bandwidth_limit, "--bandwidth-limit")
                   if args.bandwidth_limit else None)
    return _warm(mountpoint, payload, args, None if args.detach else walk)


# ---- the request ---------------------------------------------------------------------------------
def _payload(args: argparse.Namespace, command: str) -> tuple[str, dict, dict | None]:
    """The mount, the request, and what to list through the mount after a warmup (None: nothing,
    the mount's entries are not kept)."""
    if not args.datasets and not args.manifest:
        raise UsageError("name a DATASET or a --manifest")
    targets = [locate(d) for d in args.datasets]
    base = targets[0] if len(targets) == 1 and not targets[0].is_glob else None
    entries = [locate(p, base or _cwd_base()) for p in read_manifest(args.manifest, args.column)] \
        if args.manifest else []
    mountpoint = one_mount(targets + entries)
    manifest_paths = [t.path for t in entries if not t.is_glob]
    daemon = _handshake(mountpoint, [command, "warmup_paths"] if manifest_paths else [command])
    payload = {"label": args.manifest or " ".join(args.datasets)}
    plain = [t.path for t in targets if not t.is_glob] if not args.manifest else []
    payload["paths"] = plain
    payload["globs"] = [t.path for t in targets + entries if t.is_glob]
    if manifest_paths:
        payload["upload"] = _upload(mountpoint, manifest_paths)
    walk = {"paths": plain, "globs": payload["globs"], "files": manifest_paths} \
        if daemon.get("immutable") and args.list_after else None
    return mountpoint, payload, walk


def _cwd_base() -> Target | None:
    try:
        return locate(".")
    except CachefsError:
        return None


def _upload(mountpoint: str, paths: list[str]) -> str:
    """Send a manifest's paths in parts (a control request is at most 1 MiB)."""
    upload, chunk, used = None, [], 0
    for path in paths + [None]:
        if path is not None:
            chunk.append(path)
            used += len(path) + 4
        if chunk and (path is None or used >= _UPLOAD_CHUNK):
            reply = _one(mountpoint, "warmup_paths", {"paths": chunk, **({"upload": upload} if upload else {})})
            upload, chunk, used = reply["upload"], [], 0
    return upload


def _handshake(mountpoint: str, commands: list[str]) -> dict:
    """Ask the daemon what it supports and allows this user before sending anything (a manifest
    upload would otherwise be refused half-way)."""
    daemon = hello(mountpoint)
    missing = [c for c in commands if c not in daemon["commands"]]
    if missing:
        raise Unsupported(f"the cachefs daemon of {mountpoint} (version {daemon['version']}) does not support "
                          f"{', '.join(missing)}: remount it with this cachefs version")
    restricted = [c for c in commands if c in daemon["restricted"]]
    if restricted and not daemon["may_change"]:
        raise PermissionDenied(f"{mountpoint}: only root and the mount's owner may warm, evict, pin or unpin "
                               f"(--check is open to every user)")
    return daemon


def _one(mountpoint: str, command: str, payload: dict) -> dict:
    reply = next(request(mountpoint, command, **payload), None)
    if reply is None:
        raise CachefsError(f"the daemon of {mountpoint} sent no reply to {command}")
    return reply


def _simple(mountpoint: str, command: str, payload: dict, args, render) -> int:
    reply = _one(mountpoint, command, payload)
    if args.json:
        print(json.dumps(reply))
    elif not args.quiet:
        print(render(reply))
    return 0


def _warm(mountpoint: str, payload: dict, args: argparse.Namespace, walk: dict | None) -> int:
    bar = _bar(args)
    last = None
    replies = request(mountpoint, "warmup", **payload)
    try:
        for reply in replies:
            if args.json and not (walk is not None and reply.get("event") == "done"):
                print(json.dumps(reply), flush=True)        # the summary last: after the listing's
            if reply.get("event") in ("progress", "done"):
                last = reply
                if bar is not None and reply["event"] == "progress":
                    bar.update(reply)
    except KeyboardInterrupt:
        replies.close()
        if bar is not None:
            bar.close()
        if last is not None and not args.quiet:
            print(summary(last, interrupted=True), file=sys.stderr if args.json else sys.stdout)
        return WarmupExit.INTERRUPTED
    finally:
        if bar is not None:
            bar.close()
    if payload.get("detach"):
        if not args.quiet and not args.json:
            print(f"warmup of {payload['label']} started in the daemon of {mountpoint}")
        return 0
    if last is None:
        raise CachefsError("the daemon ended the warmup without a summary")
    if not args.quiet and not args.json:
        print(summary(last))
    try:
        if walk is not None and last["state"] == "done":
            _list_after(mountpoint, walk, args)
    except KeyboardInterrupt:
        return WarmupExit.INTERRUPTED
    finally:
        if args.json and walk is not None and last.get("event") == "done":
            print(json.dumps(last), flush=True)       # held back in the loop above
    return _exit_code(last)


def _list_after(mountpoint: str, walk: dict, args: argparse.Namespace) -> None:
    """List what was warmed through the mount (cachefs/warm/walk.py): the kernel keeps the entries of
    an immutable mount, and a first epoch that opens the files by name then sends no LOOKUP."""
    bar = _bar(args)
    try:
        listed = list_through(mountpoint, walk["paths"], walk["globs"], walk["files"],
                              bar.listing if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(listed.as_event()), flush=True)
    elif not args.quiet:
        print(listing_line(listed))


def _bar(args: argparse.Namespace) -> ProgressBar | None:
    """A progress line on a terminal, unless --quiet or --json."""
    return ProgressBar() if sys.stderr.isatty() and not (args.quiet or args.json) else None


def _exit_code(final: dict) -> int:
    if final["state"] == "refused":
        print(f"cachefs: warmup refused: {final['error_detail']}; use --force to warm what fits",
              file=sys.stderr)
        return WarmupExit.REFUSED
    if final["state"] == "failed":
        print(f"cachefs: warmup failed: {final.get('error_detail')}", file=sys.stderr)
        return ExitCode.UNREACHABLE
    if final["state"] == "cancelled":
        return WarmupExit.INTERRUPTED
    return WarmupExit.FAILED if final["failed_files"] else 0


def main() -> int:      # `python -m warmup.cli` for debugging; normally `cachefs warmup`
    from cachefs.cli import main as cachefs_main
    return cachefs_main(["warmup", *sys.argv[1:]])


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
