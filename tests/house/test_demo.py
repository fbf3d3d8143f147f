"""`cachefs demo` (the README's first command) end to end, small: it verifies every byte itself."""

import random
import subprocess
import sys

import pytest
from mounts import require_fuse

from cachefs.demo.run import _sample

pytestmark = pytest.mark.fuse


def test_demo_runs_end_to_end_and_verifies_every_file(tmp_path):
    require_fuse()
    result = subprocess.run([sys.executable, "-m", "cachefs", "demo", "--files", "60", "--large-size", "8M",
                             "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "all 61 files verified; object-store GETs after the remount: 0" in result.stdout
    assert "warm (disk tier)" in result.stdout and "hot (page cache)" in result.stdout
    # the warmup step fetched what the cold pass had not read (30 of 60 small files), found the rest cached
    assert "cachefs warmup" in result.stdout and "30 fetched" in result.stdout, result.stdout[-2000:]


def test_sample_data_of_the_default_large_size():
    data = _sample(random.Random(7), (256 << 20) + 5)      # randbytes alone overflows here
    assert len(data) == (256 << 20) + 5
    assert data[:1 << 20] != data[1 << 20: 2 << 20]
