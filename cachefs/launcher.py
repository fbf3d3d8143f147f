"""Start a daemon, wait until it is ready, stop it: used by the CLI and by ``csi/``.

A daemon is ``python -m cachefs _daemon READY_FD`` in its own session; where a keeper holds
the mount (``cfg.kept``, ``keeper.py``) the launcher starts ``python -m cachefs _keeper READY_FD``
and the keeper starts the daemon with the same ready pipe. The config arrives as JSON on stdin
(never argv: it may name a credentials profile, and argv is world-readable); the daemon answers on
the ready pipe with one line: ``OK PID`` once the kernel mount answers, or
``ERR <exit code> <message>`` when start-up fails (it then leaves nothing mounted).
"""

import json
import logging
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from cachefs.config import FIXED_OPTIONS, MountConfig, build_config, to_dict
from cachefs.errors import CacheDirError, CachefsError, ExitCode, MountpointError, StartTimeout
from cachefs.host import find_mount
from cachefs.keeper import HANDOVER

log = logging.getLogger("cachefs")


@dataclass(frozen=True, slots=True)
class Started:
    pid: int                    # the daemon
    log_path: str
    keeper_pid: int | None = None   # the keeper holding the mount (None: no keeper)


class StartFailed(CachefsError):
    """The daemon reported a start-up error; ``exit_code`` is the daemon's own."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def start(cfg: MountConfig, *, env: dict[str, str] | None = None,
          secrets: dict[str, str] | None = None, adopt: bool = False) -> Started:
    """Start a daemon for ``cfg`` in its own session and return once it is ready.

    ``env`` replaces the daemon's environment. ``secrets`` (environment variables such as
    AWS_SECRET_ACCESS_KEY: the CSI driver's credentials) go on the same stdin as the config, as a
    second JSON line, and the daemon sets them in its own ``os.environ`` before opening the store:
    never in argv, in the exec-time environment (/proc/PID/environ) or in a file.
    ``adopt``: the mount is live, held by another keeper (a previous node agent's); the new keeper
    takes it over through ``CACHE_DIR/keeper.sock`` instead of mounting (readers pause, never fail).
    Raises StartFailed, StartTimeout or CachefsError, leaving nothing mounted."""
    try:
        os.makedirs(os.path.dirname(cfg.log_path), exist_ok=True)
        logfile = open(cfg.log_path, "ab")  # noqa: SIM115  (handed to the child, closed below)
    except OSError as exc:
        raise CacheDirError(f"cannot open log file {cfg.log_path}: {exc.strerror}") from None
    ready_r, ready_w = os.pipe()
    role = ["_keeper", str(ready_w), *(["--adopt"] if adopt else [])] if cfg.kept else ["_daemon", str(ready_w)]
    child = subprocess.Popen([sys.executable, "-m", "cachefs", *role],
                             stdin=subprocess.PIPE, stdout=logfile, stderr=logfile, pass_fds=(ready_w,),
                             start_new_session=True, close_fds=True, env=env)
    os.close(ready_w)
    logfile.close()
    child.stdin.write(json.dumps(to_dict(cfg)).encode())
    if secrets:
        child.stdin.write(b"\n" + json.dumps(secrets).encode())
    child.stdin.close()
    line = _read_ready(ready_r, child, cfg.ready_timeout)
    if line.startswith("OK"):
        pid = int(line.split()[1]) if len(line.split()) > 1 else child.pid
        return Started(pid, cfg.log_path, child.pid if cfg.kept else None)
    if line.startswith("ERR "):
        code, _, message = line[4:].partition(" ")
        raise StartFailed(message, int(code))
    raise CachefsError(f"the daemon exited (status {child.returncode}) before the mount was ready; "
                       f"see {cfg.log_path}")


def _read_ready(fd: int, child: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    data = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                child.kill()
                child.wait()
                raise StartTimeout(f"the daemon was not ready within {timeout:.0f} s; it was stopped")
            if select.select([pipe], [], [], min(left, 0.5))[0]:
                chunk = pipe.read(4096)
                if not chunk:
                    child.wait()
                    break
                data += chunk
    return data.decode(errors="replace").strip()


def run_daemon(ready_fd: int, keeper_fd: int | None = None) -> int:
    """The daemon process's side of ``start``: config on stdin, one ready line on ``ready_fd``;
    ``keeper_fd``: the socket to the keeper that started it (it says when to serve)."""
    ready = os.fdopen(ready_fd, "w")
    try:
        config_line, _, secrets_line = sys.stdin.read().partition("\n")
        cfg = build_config(json.loads(config_line))
        if secrets_line.strip():
            os.environ.update({str(k): str(v) for k, v in json.loads(secrets_line).items()})
        setup_logging(cfg, to_stderr=False)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        from cachefs.daemon import serve
        from cachefs.keeper import Link

        link = Link(keeper_fd) if keeper_fd is not None else None     # serve waits for its word

        def on_ready() -> None:
            ready.write(f"OK {os.getpid()}\n")
            ready.close()

        status = serve(cfg, on_ready, link)
        if status == HANDOVER:          # the successor waits on our exit: skip the interpreter's teardown
            logging.shutdown()
            os._exit(status)
        return status
    except CachefsError as exc:
        log.error("%s", exc)
        _report(ready, f"ERR {exc.exit_code} {exc}")
        return exc.exit_code
    except BaseException:
        log.exception("daemon failed")
        _report(ready, f"ERR {ExitCode.INTERNAL} internal error; see the log")
        raise


def _report(ready, line: str) -> None:
    if not ready.closed:
        ready.write(line + "\n")
        ready.close()


def setup_logging(cfg: MountConfig, *, to_stderr: bool) -> None:
    handler = logging.StreamHandler(sys.stderr) if to_stderr else logging.FileHandler(cfg.log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.log_level.upper())
    # botocore's debug log carries Authorization headers: never below WARNING, even at debug.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "pyfuse3", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# ---- stop ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Stopped:
    pid: int | None             # the daemon that served the mount (None: it was already dead)
    still_running: bool         # it had not exited when the timeout ran out


def stop(mountpoint: str, *, timeout: float = 60.0, drain: bool = True, lazy: bool = False) -> Stopped:
    """Stop the daemon serving ``mountpoint``: upload what it has staged (``drain``), unmount,
    and wait up to ``timeout`` seconds for it to exit (``lazy``: detach even with open files and
    return at once; the daemon exits once they are closed). A stale mount of a dead daemon is unmounted
    all the same. Raises MountpointError (not a cachefs mount, busy), StartTimeout (the drain did
    not finish: still mounted, nothing lost) or NoDaemon/Unsupported from the control channel."""
    from cachefs.control.client import request

    if not is_cachefs_mount(mountpoint):
        raise MountpointError(f"{mountpoint} is not a mounted cachefs filesystem")
    pid = None
    try:
        pid = next(request(mountpoint, "status"))["pid"]
    except (CachefsError, StopIteration, KeyError):
        pass   # a dead daemon leaves a stale mount: unmount it all the same
    if pid is not None and drain:
        drain_writes(mountpoint, timeout)
    unmount(mountpoint, lazy=lazy)
    if lazy:       # detached: the daemon serves open files until they are closed, then exits
        return Stopped(pid, pid is not None and not wait_exit(pid, 0.5))
    return Stopped(pid, pid is not None and not wait_exit(pid, timeout))


def drain_writes(mountpoint: str, timeout: float) -> None:
    """Upload everything staged before unmounting; refuse to unmount if it does not finish in time."""
    from cachefs.control.client import hello, request

    if "sync" not in hello(mountpoint)["commands"]:
        return          # a read-only mount: nothing to drain
    final = {}
    for reply in request(mountpoint, "sync", wait=True, timeout=timeout):
        final = reply
    if final.get("done", True):
        return
    left = final["pending"]
    raise StartTimeout(f"{left['files']} file(s) ({left['bytes']} bytes) and {left['operations']} operation(s) "
                       f"not uploaded after {timeout:.0f} s (errors: {'; '.join(left['errors']) or 'none'}); "
                       f"still mounted. They stay staged: retry, or `cachefs umount --no-drain` to unmount "
                       f"now and upload them at the next mount of this cache dir")


# ---- restart -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Restarted:
    old_pid: int
    new_pid: int
    seconds: float              # from the request to the new daemon answering status


def serves(mountpoint: str, url: str) -> bool:
    """Whether the live cachefs mount at ``mountpoint`` serves ``url`` (a daemon answers it)."""
    from cachefs.control.client import request
    try:
        return next(request(mountpoint, "status")).get("url") == url
    except (CachefsError, StopIteration):
        return False


def restart(mountpoint: str, *, cfg: MountConfig | None = None, timeout: float = 60.0) -> Restarted:
    """Hand the live mount at ``mountpoint`` to a new daemon (this cachefs version; ``cfg``: new
    options, those in ``FIXED_OPTIONS`` unchanged) without unmounting: readers pause, never fail.
    Raises Unsupported where no keeper holds the mount, MountpointError for a changed fixed option,
    StartTimeout when no new daemon answers in time (the old one keeps serving if the new one failed)."""
    from cachefs.control.client import hello, request
    from cachefs.errors import Unsupported

    if not is_cachefs_mount(mountpoint):
        raise MountpointError(f"{mountpoint} is not a mounted cachefs filesystem")
    if "restart" not in hello(mountpoint)["commands"]:
        raise Unsupported(f"no keeper holds {mountpoint} (mounted with --no-keeper, --foreground or "
                          f"--fuse-backend pyfuse3): unmount and mount it again instead")
    status = next(request(mountpoint, "status"))
    args = {}
    if cfg is not None:
        old = status.get("options", {})
        changed = [name for name in FIXED_OPTIONS if name in old and old[name] != to_dict(cfg)[name]]
        if changed:
            raise MountpointError(f"{mountpoint} is busy: {status.get('url')} is mounted there with another "
                                  f"{', '.join(changed)}; mounting again hands a live mount to a new daemon only "
                                  f"when {'it stays' if len(changed) == 1 else 'they stay'} the same (unmount first)")
        args["config"] = to_dict(cfg)
    started = time.monotonic()
    old_pid = next(request(mountpoint, "restart", **args))["pid"]
    deadline = started + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            pid = next(request(mountpoint, "status"))["pid"]
        except (CachefsError, StopIteration, KeyError):
            continue
        if pid != old_pid:
            return Restarted(old_pid, pid, time.monotonic() - started)
        if not process_alive(old_pid):
            continue
    raise StartTimeout(f"no new daemon took {mountpoint} over within {timeout:.0f} s (see the log); "
                       f"pid {old_pid} keeps serving it")


# ---- warm ----------------------------------------------------------------------------------------
def warm(mountpoint: str, paths: list[str], *, detach: bool = False, concurrency: int = 32) -> dict | None:
    """Have the daemon at ``mountpoint`` warm ``paths`` (relative to the mount root) into its disk
    tier; its final report (``state``: done, refused, failed, cancelled; counts), or None when
    ``detach`` (it goes on in the daemon). A warmup done on an immutable mount is then listed
    through the mount (``warm/walk.py``; the report's ``listed``: its counts). Raises NoDaemon,
    PermissionDenied, Unsupported (the control channel's typed errors) or CachefsError when the
    daemon gives no report."""
    from cachefs.control.client import hello, request
    from cachefs.warm.walk import list_through

    clean = [p.strip("/") for p in paths]
    payload = {"label": ", ".join(clean) or "/", "paths": clean, "globs": [], "concurrency": concurrency,
               "force": False, "pin": False, "detach": detach, "bandwidth_limit": None}
    final = None
    for reply in request(mountpoint, "warmup", **payload):
        if reply.get("event") == "done":
            final = reply
    if detach:
        return None
    if final is None:
        raise CachefsError(f"the daemon of {mountpoint} ended the warmup without a report")
    if final["state"] == "done" and hello(mountpoint).get("immutable"):
        final["listed"] = list_through(mountpoint, clean, [], []).as_event()
    return final


def unmount(mountpoint: str, *, lazy: bool = False) -> None:
    """fusermount3 -u (-z); MountpointError with fusermount's reason when it refuses."""
    command = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mountpoint]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        raise MountpointError(f"cannot unmount {mountpoint}: {reason}"
                              + ("" if lazy else " (close open files, or use --lazy)"))


def is_cachefs_mount(mountpoint: str) -> bool:
    entry = find_mount(mountpoint)
    return entry is not None and entry[1].startswith("fuse")


def wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.02)
    return False


def process_alive(pid: int) -> bool:
    """Running, not a zombie: the daemon is another session's child, and whoever reaps it
    (init, a container's pid 1) may take a while; it has finished once it is a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
