"""The `cachefs` command. Thin: parse, build a config, call the engine, map errors to exit codes."""

import argparse
import json
import logging
import os
import signal
import sys

from cachefs import __version__, errors, launcher
from cachefs.config import MountConfig, build_config, load_toml, option_fields, render_default
from cachefs.errors import CachefsError, ExitCode, UsageError, exit_codes_help
from cachefs.extras import require
from cachefs.host import check_cache_fs

log = logging.getLogger("cachefs")

EXIT_CODES = exit_codes_help(c for c in errors.EXIT_CODES if c < 21 and c not in (11, 12))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One short usage line and the error (argparse's own usage of `mount` runs to ~55 lines)."""
        self.exit(ExitCode.USAGE, f"usage: {short_usage(self)}\ncachefs: error: {message}\n")


def short_usage(parser: argparse.ArgumentParser) -> str:
    """``PROG POSITIONAL... [options]``: the command's shape on one line, --help for the rest."""
    words = [parser.prog]
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            words.append(action.metavar if isinstance(action.metavar, str) else action.dest.upper())
        elif isinstance(action, argparse._SubParsersAction):
            words.append("COMMAND")
    return " ".join(words) + " [options] (--help for more)"


# ---- mount ---------------------------------------------------------------------------------------
def _add_mount_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help=MountConfig.__dataclass_fields__["url"].metadata["help"])
    parser.add_argument("mountpoint", help="an existing directory to mount on")
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file with any of the options below "
                        "(same names, with _ or -); flags override it")
    for f in option_fields():
        flag = "--" + f.name.replace("_", "-")
        default = render_default(f)
        text = f.metadata["help"] + ("" if default == "-" else f" (default: {default})")
        if "bool" in str(f.type):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=text)
        else:
            parser.add_argument(flag, default=argparse.SUPPRESS, metavar=f.name.upper(), help=text)


def config_from_args(args: argparse.Namespace) -> MountConfig:
    values = load_toml(args.config) if args.config else {}
    values.update({f.name: getattr(args, f.name) for f in option_fields() if hasattr(args, f.name)})
    values["url"], values["mountpoint"] = args.url, args.mountpoint
    return build_config(values)


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if not cfg.foreground and launcher.is_cachefs_mount(cfg.mountpoint) and launcher.serves(cfg.mountpoint, cfg.url):
        done = launcher.restart(cfg.mountpoint, cfg=cfg, timeout=cfg.ready_timeout)
        print(f"cachefs: {cfg.url} was mounted at {cfg.mountpoint}: handed to a new daemon (pid {done.new_pid}, "
              f"was {done.old_pid}) in {done.seconds:.2f} s, without unmounting", file=sys.stderr)
        return 0
    warning = check_cache_fs(cfg.cache_dir, cfg.cache_size, cfg.staging_path, cfg.disk_path)
    if warning:
        print(f"cachefs: warning: {warning}", file=sys.stderr)
    if cfg.foreground:
        from cachefs.daemon import serve
        launcher.setup_logging(cfg, to_stderr=True)
        serve(cfg, lambda: print(f"cachefs: mounted {cfg.url} at {cfg.mountpoint}", file=sys.stderr))
        return 0
    try:
        started = launcher.start(cfg)
    except launcher.StartFailed as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"cachefs: mounted {cfg.url} at {cfg.mountpoint} (pid {started.pid}, log {started.log_path})",
          file=sys.stderr)
    return 0


def cmd_daemon(args: argparse.Namespace) -> int:
    """Internal: the daemon process started by `mount` (config on stdin, ready line on a pipe)."""
    return launcher.run_daemon(int(args.ready_fd), None if args.keeper_fd is None else int(args.keeper_fd))


def cmd_keeper(args: argparse.Namespace) -> int:
    """Internal: the keeper process started by `mount` (cachefs/keeper.py)."""
    from cachefs.keeper import run_keeper
    return run_keeper(int(args.ready_fd), args.adopt)


# ---- umount, sync, status ----------------------------------------------------------------------------
def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    stopped = launcher.stop(mountpoint, timeout=args.timeout, drain=args.drain, lazy=args.lazy)
    if stopped.still_running and args.lazy:
        print(f"cachefs: detached {mountpoint}; the daemon (pid {stopped.pid}) serves the files still open "
              f"and exits when the last one is closed", file=sys.stderr)
        return 0
    if stopped.still_running:
        print(f"cachefs: warning: daemon pid {stopped.pid} still running after {args.timeout:.0f} s", file=sys.stderr)
    print(f"cachefs: unmounted {mountpoint}", file=sys.stderr)
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    from cachefs.control.client import hello, request
    from cachefs.control.status_view import pending_line

    mountpoint = os.path.abspath(args.mountpoint)
    if "sync" not in hello(mountpoint)["commands"]:
        raise UsageError(f"{args.mountpoint} is a read-only mount: nothing to sync")
    final = {}
    for reply in request(mountpoint, "sync", wait=args.wait, timeout=args.timeout,
                         **({"class": args.sync_class} if args.sync_class else {})):
        if "progress" in reply and sys.stderr.isatty():
            print(f"\rcachefs: {pending_line(reply['progress'])}", end="", file=sys.stderr)
        final = reply
    if sys.stderr.isatty() and args.wait:
        print(file=sys.stderr)
    done = final.get("done")
    state = "synced" if done else ("uploading" if not args.wait else "NOT synced")
    print(f"cachefs: {state}; pending: {pending_line(final.get('pending', {}))}")
    return 0 if done or not args.wait else ExitCode.TIMEOUT


def cmd_restart(args: argparse.Namespace) -> int:
    mountpoint = os.path.abspath(args.mountpoint)
    done = launcher.restart(mountpoint, timeout=args.timeout)
    print(f"cachefs: {mountpoint} is served by pid {done.new_pid} (was {done.old_pid}); "
          f"restarted in {done.seconds:.2f} s without unmounting", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cachefs.control.client import request
    from cachefs.control.status_view import render

    status = next(request(os.path.abspath(args.mountpoint), "status"))
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    require("server", "cachefs demo")
    from cachefs.demo.run import run_demo
    return run_demo(files=args.files, large_size=args.large_size, workdir=args.workdir)


# ---- parser ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cachefs", description="A caching FUSE filesystem for ML datasets on S3 / Ceph RGW.",
                     epilog=exit_codes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cachefs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mount = sub.add_parser("mount", help="mount a bucket prefix with a memory and a disk cache tier",
                           epilog=EXIT_CODES + "\n\nCredentials come from the standard AWS chain "
                           "(AWS_ACCESS_KEY_ID/..., AWS_PROFILE, ~/.aws/credentials), never from flags.",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_mount_options(mount)
    mount.set_defaults(func=cmd_mount)

    umount = sub.add_parser("umount", help="unmount and wait for the daemon to finish")
    umount.add_argument("mountpoint")
    umount.add_argument("--lazy", action="store_true", help="detach now even if files are open")
    umount.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for staged files to upload, then for the daemon to exit")
    umount.add_argument("--drain", action=argparse.BooleanOptionalAction, default=True,
                        help="upload staged files before unmounting (--no-drain: unmount now; they upload "
                        "at the next mount of the same cache dir)")
    umount.set_defaults(func=cmd_umount)

    sync = sub.add_parser("sync", help="upload staged (written) files now and report what is pending")
    sync.add_argument("mountpoint")
    sync.add_argument("--class", dest="sync_class", choices=("log", "checkpoint"), help="only this sync class")
    sync.add_argument("--wait", action="store_true", help="return when everything is in the store")
    sync.add_argument("--timeout", type=float, default=3600.0, help="seconds --wait waits at most")
    sync.set_defaults(func=cmd_sync)

    restart = sub.add_parser("restart", help="hand a live mount to a new daemon (this cachefs version) "
                             "without unmounting: readers pause, never fail")
    restart.add_argument("mountpoint")
    restart.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the new daemon")
    restart.set_defaults(func=cmd_restart)

    status = sub.add_parser("status", help="tier usage and hit ratios of a running mount")
    status.add_argument("mountpoint")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="end-to-end demo on a local S3 server with a sample dataset")
    demo.add_argument("--files", type=int, default=2000, help="small files in the sample dataset")
    demo.add_argument("--large-size", default="256M", help="size of the one large file")
    demo.add_argument("--workdir", default=None, help="where to put the mount and cache (default: a temp dir)")
    demo.set_defaults(func=cmd_demo)

    daemon = sub.add_parser("_daemon")
    daemon.add_argument("ready_fd")
    daemon.add_argument("--keeper-fd", default=None)
    daemon.set_defaults(func=cmd_daemon)
    keeper = sub.add_parser("_keeper")
    keeper.add_argument("ready_fd")
    keeper.add_argument("--adopt", action="store_true")
    keeper.set_defaults(func=cmd_keeper)
    _add_plugin_commands(sub)
    sub.metavar = "{" + ",".join(public_commands(sub)) + "}"
    return parser


def public_commands(sub: argparse._SubParsersAction) -> list[str]:
    """Every subcommand a user may type (the core's and the plugins'), in registration order."""
    return [name for name in sub.choices if not name.startswith("_")]


def _add_plugin_commands(sub) -> None:
    """Subcommands of the packages beside the core (warmup, pack, csi): each registers itself
    under the ``cachefs.commands`` entry-point group, so the core never imports them."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group="cachefs.commands"), key=lambda e: e.name):
        entry.load()(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except UsageError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except CachefsError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
