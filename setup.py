"""Build hook: generate the CSI gRPC stubs (csi/_proto/) before packaging; everything else is in
pyproject.toml. The stubs are also generated lazily on first import (csi/proto.py), so an editable
install or a fresh clone works without this hook having run."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithProto(build_py):
    def run(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from csi import _build

        _build.generate()
        if self.packages is not None and "csi._proto" not in self.packages:
            self.packages.append("csi._proto")
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto})
