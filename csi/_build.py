"""Generate the gRPC stubs of ``csi/csi.proto`` into ``csi/_proto/`` (never committed, never linted).

Run by the setuptools build hook (``setup.py``) and, lazily, by ``csi.proto`` on first import when
the stubs are missing or older than the .proto (an editable install, a fresh clone). The proto is
compiled as ``csi/_proto/csi.proto`` so the generated service module imports its messages as
``csi._proto.csi_pb2``. Files are written to a temporary directory and renamed into place, so two
processes generating at once never see a half-written module.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "csi.proto"
OUT = HERE / "_proto"
MODULES = ("csi_pb2.py", "csi_pb2_grpc.py")


def stale(out: Path = OUT) -> bool:
    """True when a stub is missing or older than the .proto (an installed wheel carries the stubs
    but not the .proto: its stubs are never stale)."""
    try:
        built = min((out / name).stat().st_mtime for name in (*MODULES, "__init__.py"))
    except FileNotFoundError:
        return True
    try:
        return built < PROTO.stat().st_mtime
    except FileNotFoundError:
        return False


def generate(out: Path = OUT) -> None:
    """Compile the .proto with grpcio-tools into ``out`` (a package directory)."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError("grpcio-tools is missing: pip install 'cachefs[csi]'") from None
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    with tempfile.TemporaryDirectory(prefix="csi-proto-") as tmp:
        source = Path(tmp, "src", "csi", "_proto")
        source.mkdir(parents=True)
        shutil.copyfile(PROTO, source / "csi.proto")
        built = Path(tmp, "out")
        built.mkdir()
        status = protoc.main(["grpc_tools.protoc", f"-I{tmp}/src", f"-I{include}", f"--python_out={built}",
                              f"--grpc_python_out={built}", str(source / "csi.proto")])
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (status {status})")
        out.mkdir(exist_ok=True)
        generated = built / "csi" / "_proto"
        (generated / "__init__.py").write_text('"""Generated from csi/csi.proto by csi/_build.py; do not edit."""\n')
        for name in (*MODULES, "__init__.py"):
            temp = out / f".{name}.{os.getpid()}.tmp"
            shutil.copyfile(generated / name, temp)
            os.replace(temp, out / name)


def ensure() -> None:
    if stale():
        generate()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
