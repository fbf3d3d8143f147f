"""The house plan holds (docs/architecture.md): no import circle in the core, the core never imports
the packages beside it, control clients load only the protocol, no module grows past ~600 lines."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


def test_the_daemon_loads_no_packer_dependencies():
    """pyarrow and numpy come with the `packer` extra, not with the core: a plain mount (the daemon,
    the CLI) must start without them; only a packed dataset's mount loads them, when it finds one."""
    code = ("import sys, cachefs.cli, cachefs.daemon, cachefs.launcher; "
            "print(sorted(m for m in ('pyarrow', 'numpy', 'crc32c') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
