"""The one command table of the control file: every command, its handler, its arguments, and
whether it changes state (then only root and the mount's owner may run it; see ``server``).

Open to every user who can open the control file: ``hello``, ``status``, ``warmup_check``.
Owner only: ``sync`` (uploads), ``warmup`` (fills the cache), ``warmup_evict``, ``warmup_unpin``,
``warmup_paths`` (it keeps a manifest's paths in the daemon's memory until a warmup uses them),
and ``restart`` (a new daemon takes the live mount over; only where a keeper holds it).
"""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cachefs.control.protocol import Arg

Handler = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]


@dataclass(frozen=True)
class Command:
    name: str
    handler: Handler
    changes_state: bool
    args: dict[str, Arg]


DATASET_ARGS = {"label": Arg(str), "paths": Arg(list), "globs": Arg(list), "upload": Arg(str)}
WARMUP_ARGS = DATASET_ARGS | {"concurrency": Arg(int), "force": Arg(bool), "pin": Arg(bool),
                              "detach": Arg(bool), "bandwidth_limit": Arg(float)}
SYNC_ARGS = {"class": Arg(str, choices=("log", "checkpoint")), "wait": Arg(bool), "timeout": Arg(float)}
# name -> (changes state, args) of the warm engine's commands (``Warmer.commands()``)
WARM_COMMANDS = {"warmup": (True, WARMUP_ARGS),
                 "warmup_paths": (True, {"paths": Arg(list), "upload": Arg(str)}),
                 "warmup_check": (False, DATASET_ARGS),
                 "warmup_evict": (True, DATASET_ARGS),
                 "warmup_unpin": (True, DATASET_ARGS)}


def command_table(status: Callable[[], dict], warm: dict[str, Handler],
                  sync: Handler | None, restart: Handler | None = None) -> dict[str, Command]:
    """The daemon's commands. ``status`` returns the status dict; ``warm`` is the warm engine's
    ``commands()``; ``sync`` is None on a read-only mount (the command does not exist there);
    ``restart`` None where no keeper holds the mount."""
    if set(warm) != set(WARM_COMMANDS):     # the engine and this table must name the same commands
        raise RuntimeError(f"warm engine commands {sorted(warm)} != the table's {sorted(WARM_COMMANDS)}")
    commands = [Command("status", _once(status), False, {})]
    commands += [Command(name, warm[name], changes, args) for name, (changes, args) in WARM_COMMANDS.items()]
    if sync is not None:
        commands.append(Command("sync", sync, True, SYNC_ARGS))
    if restart is not None:
        commands.append(Command("restart", restart, True, {"config": Arg(dict)}))
    return {c.name: c for c in commands}


def _once(produce: Callable[[], dict]) -> Handler:
    async def handler(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield produce()
    return handler
