"""`cachefs pack` and `cachefs unpack`: parse, open the stores, run the engine, print the summary.

Registered as `cachefs` subcommands through the ``cachefs.commands`` entry point.
"""

import argparse

from cachefs.config import parse_endpoint, parse_size
from cachefs.control.status_view import size
from cachefs.errors import UsageError, exit_codes_help
from cachefs.extras import require

from .options import DEFAULT_SHARD_SIZE, PackOptions, StoreOptions
from .progress import Progress
from .stores import local_root, open_location, to_url

# The engine modules (pyarrow, numpy) are imported when a command runs, not when `cachefs` builds
# its parser: every other subcommand (mount, status, ...) would pay their import time.

EXIT_CODES = exit_codes_help([0, 2, 3, 4, 5, 21, 22, 23, 24, 25, 130]) + """
A pack that fails publishes nothing: DST/manifest.json is written last."""


def _store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint-url", help="S3 endpoint (Ceph RGW, MinIO, a local server): http(s)://HOST[:PORT]; "
                   "default AWS")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--profile", help="AWS profile (credentials come from the standard AWS chain)")
    p.add_argument("--concurrency", type=int, default=32, help="parallel GETs (default 32)")
    p.add_argument("--json", action="store_true", help="progress and summary as JSON lines on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary")


def register_pack(subparsers) -> None:
    p = subparsers.add_parser(
        "pack", help="pack many small files into TFRecord shards with a Parquet index",
        description="Pack every file below SRC into DST/shards/NNNNN.tfrecord with a Parquet index and "
        "DST/manifest.json (written last). SRC and DST are s3://bucket/prefix, any fsspec URL, or local "
        "directories; DST must be empty (or hold an interrupted pack, which a rerun resumes). "
        "See docs/packer.md.", epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("locations", nargs="+", metavar="SRC DST", help="SRC DST (or DST alone with --merge/--verify)")
    p.add_argument("--shard-size", default=str(DEFAULT_SHARD_SIZE), help="target shard size (default 256M)")
    p.add_argument("--worker-index", type=int, default=None, help="this worker's index (0-based) of --worker-count")
    p.add_argument("--worker-count", type=int, default=None, help="pack with this many workers; then --merge")
    p.add_argument("--append", action="store_true", help="add new and changed files as a new generation; "
                   "deleted files are tombstoned")
    p.add_argument("--merge", action="store_true", help="DST only: merge the workers' parts and publish")
    p.add_argument("--verify", action="store_true", help="DST only: re-read every record against the index")
    _store_flags(p)
    p.set_defaults(func=run_pack)


def register_unpack(subparsers) -> None:
    p = subparsers.add_parser(
        "unpack", help="restore the original tree of a packed dataset",
        description="Write every file of the packed dataset DST below OUT (a directory or a store URL), with "
        "its bytes, mode and mtime; every file's crc32c is checked.", epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dst", metavar="DST")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--overwrite", action="store_true",
                   help="replace files OUT already holds at the dataset's paths (refused by default, exit 2)")
    _store_flags(p)
    p.set_defaults(func=run_unpack)


def _stores(args: argparse.Namespace) -> StoreOptions:
    endpoint = parse_endpoint(args.endpoint_url) if args.endpoint_url is not None else None
    return StoreOptions(endpoint_url=endpoint, region=args.region, profile=args.profile)


def _check_shared_flags(args: argparse.Namespace) -> None:
    """The flags every pack and unpack command takes (``_store_flags``)."""
    _stores(args)
    if args.concurrency < 1:
        raise UsageError("--concurrency must be >= 1")


def _inside(inner: str, outer: str) -> bool:
    """Location ``inner`` is ``outer`` or below it."""
    return f"{to_url(inner)}/".startswith(f"{to_url(outer)}/")


def _pack_options(args: argparse.Namespace) -> PackOptions:
    shard_size = parse_size(args.shard_size, "--shard-size")
    if shard_size < 1:
        raise UsageError("--shard-size must be > 0")
    if (args.worker_index is None) != (args.worker_count is None):
        raise UsageError("give --worker-index and --worker-count together")
    index, count = (0, 1) if args.worker_count is None else (args.worker_index, args.worker_count)
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--worker-index must be in 0..{count - 1} and --worker-count >= 1")
    return PackOptions(shard_size=shard_size, concurrency=args.concurrency, worker_index=index,
                       worker_count=count, append=args.append)


def run_pack(args: argparse.Namespace) -> int:
    require("packer", "cachefs pack")
    _check_shared_flags(args)
    progress = Progress("verify" if args.verify else "pack", json_lines=args.json, quiet=args.quiet)
    if args.merge or args.verify:
        if len(args.locations) != 1 or (args.merge and args.verify):
            raise UsageError("--merge and --verify take DST alone (one of them)")
        dst = open_location(args.locations[0], _stores(args))
        return _merge(dst, progress) if args.merge else _verify(dst, progress, args)
    if len(args.locations) != 2:
        raise UsageError("give SRC and DST")
    return _pack(args, progress)


def _pack(args: argparse.Namespace, progress: Progress) -> int:
    from .engine import Worker, plan_pack
    from .lease import Lease

    options = _pack_options(args)
    src_arg, dst_arg = args.locations
    if _inside(dst_arg, src_arg):
        raise UsageError("DST must not be SRC or inside it (the pack would list its own shards)")
    src, dst = open_location(src_arg, _stores(args)), open_location(dst_arg, _stores(args))
    with Lease(dst, options.worker_index):
        plan = plan_pack(src, dst, local_root(src_arg), options)
        if not plan.shards and not plan.deleted and options.append:
            progress.finish({"changed": 0}, f"pack --append: nothing changed below {to_url(src_arg)}")
            return 0
        mine = Worker(src, dst, to_url(src_arg), options, progress).run(plan)
        if options.worker_count > 1:
            progress.finish({"worker": options.worker_index, "shards_written": len(mine)},
                            f"pack worker {options.worker_index}/{options.worker_count}: {len(mine)} shards done; "
                            f"when every worker is done: cachefs pack --merge {dst_arg}")
            return 0
        return _merge(dst, progress)


def _merge(dst, progress: Progress) -> int:
    from .merge import merge

    m = merge(dst)
    progress.finish({"generation": m.generation, "total_files": m.files, "total_bytes": m.bytes,
                     "total_shards": m.shards},
                    f"packed {m.files} files ({size(m.bytes)}) into {m.shards} shards ({size(m.shard_bytes)}), "
                    f"generation {m.generation}")
    return 0


def _verify(dst, progress: Progress, args: argparse.Namespace) -> int:
    from .verify import verify

    report = verify(dst, progress, args.concurrency)
    progress.finish(report, f"verified {report['files']} files in {report['shards']} shards: all records match")
    return 0


def run_unpack(args: argparse.Namespace) -> int:
    require("packer", "cachefs unpack")
    from .unpack import unpack

    _check_shared_flags(args)
    if _inside(args.out, args.dst):
        raise UsageError("OUT must not be DST or inside it (a mount of DST shows only the packed dataset)")
    progress = Progress("unpack", json_lines=args.json, quiet=args.quiet)
    dst, out = open_location(args.dst, _stores(args)), open_location(args.out, _stores(args))
    report = unpack(dst, out, local_root(args.out), progress, args.concurrency, overwrite=args.overwrite)
    progress.finish(report, f"unpacked {report['files']} files ({size(report['bytes'])}) into {args.out}")
    return 0
