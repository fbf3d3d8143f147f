"""The house plan holds (docs/architecture.md): no import circle in the core, the core never imports
the packages beside it, control clients load only the protocol, no module grows past ~600 lines."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "cachefs"
BESIDE = ("warmup", "packer", "csi")
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> dict[str, Path]:
    return {module_name(p): p for p in CORE.rglob("*.py")}


def imports_of(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The core module an import names (``a.b.c`` may be module ``a.b`` importing name ``c``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    modules = core_modules()
    graph = {}
    for name, path in modules.items():
        targets = {resolve(i, modules) for i in imports_of(path, top_level_only=True)}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_core_has_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_core_never_imports_the_packages_beside_it():
    offenders = {}
    for name, path in core_modules().items():
        bad = {i for i in imports_of(path, top_level_only=False) if i.split(".")[0] in BESIDE}
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}


def test_no_module_is_over_600_lines():
    paths = [p for base in ("cachefs", *BESIDE) for p in (ROOT / base).rglob("*.py") if "_proto" not in p.parts]
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_control_clients_load_no_daemon_stack():
    """`cachefs warmup` and `cachefs status` start fast: importing them loads neither trio, pyfuse3
    nor boto3 (the daemon's stack)."""
    code = ("import sys, warmup.cli, cachefs.control.client; "
            "print(sorted(m for m in ('trio', 'pyfuse3', 'boto3', 'botocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_loader_loads_no_daemon_stack():
    """`import cachefs.data` happens in every training process (and each DataLoader worker): it
    loads neither trio nor prometheus_client nor boto3, only what reading shards needs."""
    code = ("import sys, cachefs.data, cachefs.data.direct, cachefs.data.shards; "
            "print(sorted(m for m in ('trio', 'prometheus_client', 'boto3', 'botocore', 'pyfuse3') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_daemon_loads_no_packer_dependencies():
    """pyarrow and numpy come with the `packer` extra, not with the core: a plain mount (the daemon,
    the CLI) must start without them; only a packed dataset's mount loads them, when it finds one."""
    code = ("import sys, cachefs.cli, cachefs.daemon, cachefs.launcher; "
            "print(sorted(m for m in ('pyarrow', 'numpy', 'crc32c') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_room_assigns_another_rooms_hook():
    """Calls upward go through Ports (cachefs/ports.py) that constructors take as arguments and
    daemon.py wires: no module sets an ``on_*`` attribute of an object other than itself, and
    ports are created only where they are wired (daemon.py) or as a constructor's default."""
    offenders = []
    for base in ("cachefs", *BESIDE):
        for path in (ROOT / base).rglob("*.py"):
            if "_proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, (ast.AnnAssign, ast.AugAssign)) else []
                for target in targets:
                    if (isinstance(target, ast.Attribute) and target.attr.startswith("on_")
                            and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Port"
                        and path.name != "daemon.py" and _enclosing_function(path, node.lineno) != "__init__"):
                    # a Port is made where it is wired, or as a constructor's default for tests
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} Port() outside the wiring")
    assert offenders == []


def test_the_namespace_reads_bytes_only_through_its_content_sources():
    """One content seam (cachefs/namespace/content.py): outside it, no module of the namespace
    calls a read or preload of the tiers, the packed view or the write-back."""
    offenders = []
    for path in (CORE / "namespace").glob("*.py"):
        if path.name in ("content.py", "packed.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("read", "read_now", "preload") and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr in ("blocks", "packed", "wb")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.value.attr}.{node.func.attr}")
    assert offenders == []


def test_test_modules_share_support_modules_not_each_other():
    """tests/ is grouped like the packages; what groups share lives in support modules at its top
    (docs/architecture.md, "Lifecycle and test support"): no test module imports another."""
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        names = imports_of(path, top_level_only=False)
        offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert offenders == []
    assert not list((ROOT / "tests").glob("test_*.py")), "test modules belong in a group (tests/<group>/)"


def _enclosing_function(path: Path, lineno: int) -> str | None:
    best = None
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= lineno <= node.end_lineno
                and (best is None or node.lineno > best.lineno)):
            best = node
    return best.name if best is not None else None


# ---- docs/architecture.md's table of packages says what their code reads ------------------------

BASICS = {"errors", "config", "metrics", "ports", "sched", "singleflight", "host", "extras", "__init__", "__main__"}


def _doc_rows() -> list[tuple[list[str], list[str] | None]]:
    """(paths, names read) for each row of the table; None: 'every core package'."""
    rows = []
    for line in (ROOT / "docs/architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 3 or not cells[0].startswith("`cachefs/"):
            continue
        paths = [p.strip("`").rstrip("/") for p in cells[0].split(", ")]
        reads = None if "every core package" in cells[2] else [
            name for name in re.findall(r"`([a-z_.]+)`", cells[2])]
        rows.append((paths, reads))
    return rows


def _row_files(paths: list[str]) -> list[Path]:
    files = []
    for p in paths:
        target = ROOT / p
        files += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    return files


def _core_reads(files: list[Path], own: set[str]) -> set[str]:
    """The core packages and modules (cachefs.X, or cachefs.X.Y for the packages' faces) these
    files import, outside their own and the basics."""
    modules = core_modules()
    found = set()
    for path in files:
        for name in imports_of(path, top_level_only=False):
            target = resolve(name, modules)
            if target is None or not target.startswith("cachefs."):
                continue
            top = target.split(".")[1]
            if top in BASICS or any(target == o or target.startswith(o + ".") for o in own):
                continue
            found.add(target)
    return found


def test_the_architecture_tables_paths_are_the_real_ones():
    rows = _doc_rows()
    listed = {p for paths, _ in rows for p in paths}
    for path in listed:
        assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"
    tops = {p.name.removesuffix(".py") for p in CORE.iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())}
    missing = {t for t in tops - BASICS - {"demo"} if not any(p.split("/")[1].removesuffix(".py") == t for p in listed)}
    assert missing == set(), f"core modules missing from docs/architecture.md: {sorted(missing)}"


def test_the_architecture_table_says_what_each_package_reads():
    wrong = []
    for paths, reads in _doc_rows():
        if reads is None:
            continue
        own = {p.removesuffix(".py").replace("/", ".") for p in paths}
        actual = _core_reads(_row_files(paths), own)
        base = paths[0].removesuffix(".py").replace("/", ".")
        said = set()
        for name in reads:
            if name.split(".")[0] in BASICS:
                continue
            for candidate in (f"cachefs.{name}", f"{base}.{name}"):
                if candidate in core_modules() or any(m.startswith(candidate + ".") for m in core_modules()):
                    said.add(candidate)
                    break
            else:
                wrong.append(f"{paths[0]}: names {name!r}, which is no core module")
        unsaid = {a for a in actual if not any(a == s or a.startswith(s + ".") for s in said)}
        unread = {s for s in said if not any(a == s or a.startswith(s + ".") for a in actual)
                  and not any(s == o or s.startswith(o + ".") for o in own)}
        if unsaid or unread:
            wrong.append(f"{paths[0]}: reads {sorted(unsaid)} not listed; lists {sorted(unread)} not read")
    assert wrong == []


def test_nothing_outside_the_tiers_reaches_into_them():
    """``Tiers`` is the tiers' one interface (range eviction, a shared stream's readahead, the
    loader channel's cache files, observers through ports): outside ``cachefs/tiers/`` and the
    wiring, no module touches ``tiers.memory`` or ``tiers.disk`` or a private member."""
    offenders = []
    for path in CORE.rglob("*.py"):
        if "tiers" in path.relative_to(CORE).parts or path.name == "daemon.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if name == "tiers" and (node.attr in ("memory", "disk") or node.attr.startswith("_")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} tiers.{node.attr}")
    assert offenders == []


def test_every_option_is_read_and_the_wiring_threads_few():
    """Each component builds its own options from the mount config (``from_config``): every
    option is read somewhere, and daemon.py reads only what the wiring itself decides on."""
    from cachefs.config import option_fields
    names = {f.name for f in option_fields()}
    read, in_daemon = set(), set()
    for path in [*CORE.rglob("*.py"), *(ROOT / "csi").rglob("*.py")]:
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
                    and node.value.id in ("cfg", "config", "self")):
                read.add(node.attr)
                if path.name == "daemon.py" and node.value.id == "cfg":
                    in_daemon.add(node.attr)
    assert names - read == set(), "options nothing reads"
    # the mount's identity and places, and what decides which parts exist
    assert in_daemon <= {"url", "mountpoint", "cache_dir", "volume_id", "staging_path", "immutable", "writable",
                         "fuse_backend", "fsync", "list_ahead", "metadata_ttl", "mem_cache_size", "allow_other",
                         "metrics_port", "metrics_host", "drain_timeout", "cache_size", "allow_empty_prefix",
                         "fuse_read_ahead_kb", "fuse_max_background", "log_level", "owner"}, sorted(in_daemon)
