"""Warmup globs over "/"-separated mount paths.

Light on purpose (``re`` only): `cachefs warmup` imports it to list a warmed glob through the
mount, the daemon's warm engine to match one against the listing.
"""

import re


def glob_regex(pattern: str) -> re.Pattern:
    """A glob over "/"-separated paths: ``*``, ``?`` and ``[...]`` stay within one component,
    a ``**`` component matches any number of them."""
    out = []
    segments = pattern.split("/")
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if seg == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
        else:
            out.append(_segment_regex(seg) + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z")


def _segment_regex(seg: str) -> str:
    out, i = [], 0
    while i < len(seg):
        c = seg[i]
        close = seg.find("]", i + 2) if c == "[" else -1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif close > 0:
            body = seg[i + 1:close]
            out.append("[^" + re.escape(body[1:]) + "]" if body[:1] in ("!", "^")
                       else "[" + re.escape(body) + "]")
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def static_dir(pattern: str) -> str:
    """The directory above a glob's first wildcard component."""
    static = []
    for seg in pattern.split("/")[:-1]:
        if any(c in seg for c in "*?["):
            break
        static.append(seg)
    return "/".join(static)
