"""benchmarks/cpu_meter.py: CPU charged to the right process group, and the per-file arithmetic.

Real subprocesses burn real CPU; the assertions are loose lower and upper bounds
(the clock tick is 10 ms and the machine may be busy with other work).
"""

import os
import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.cpu_meter import (
    CpuMeter,
    box_busy_s,
    client_cpu_s,
    pids_with_arg,
    process_cpu_s,
)

BURN = "import sys, time\nend = time.process_time() + float(sys.argv[1])\nwhile time.process_time() < end: pass\n"
IDLE = "import sys, time\ntime.sleep(float(sys.argv[1]))\n"
BURN_THEN_IDLE = BURN + "time.sleep(30)\n"          # stays alive: a daemon outlives the measured block


def _spawn(code: str, seconds: float, tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, str(seconds), tag])


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def test_pids_with_arg_finds_a_process_by_a_whole_argument(procs):
    tag = f"/tmp/cpu-meter-{uuid.uuid4().hex}"
    procs.append(_spawn(IDLE, 30, tag))
    deadline = time.monotonic() + 10
    while not pids_with_arg(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_with_arg(tag) == [procs[0].pid]
    assert pids_with_arg(tag[:-1]) == []        # a prefix of an argument is not the argument


def test_process_cpu_of_a_gone_pid_is_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_cpu_s(proc.pid) == 0.0


def test_a_busy_process_is_charged_to_its_group_and_an_idle_one_is_not(procs):
    busy = _spawn(BURN_THEN_IDLE, 0.6, "busy")
    idle = _spawn(IDLE, 30, "idle")
    procs += [busy, idle]
    with CpuMeter(daemon=[busy.pid], store=[idle.pid, None]) as meter:
        deadline = time.monotonic() + 30
        while process_cpu_s(busy.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert 0.4 <= meter.spent["daemon"] <= 1.5
    assert meter.spent["store"] < 0.1
    assert meter.spent["total"] >= meter.spent["daemon"] - 0.05     # the box saw the burn too
    figures = meter.per_file(100)
    assert figures["cpu_daemon_ms"] == pytest.approx(meter.spent["daemon"] * 10, rel=0.01)
    assert figures["cpu_total_ms"] >= figures["cpu_daemon_ms"] - 0.5
    assert figures["cap_files_s"] == pytest.approx(os.cpu_count() * 1e3 / figures["cpu_total_ms"], rel=0.01)
    assert 0.1 < figures["cpu_cores"] <= os.cpu_count() + 0.2


def test_client_cpu_counts_this_process_and_waited_children():
    before = client_cpu_s()
    subprocess.run([sys.executable, "-c", BURN, "0.3"], check=True)   # a waited child
    end = time.process_time() + 0.2
    while time.process_time() < end:                                   # this process
        pass
    assert client_cpu_s() - before >= 0.4


def test_box_busy_only_grows():
    first = box_busy_s()
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert box_busy_s() >= first + 0.05


def test_per_file_of_nothing_is_empty():
    with CpuMeter() as meter:
        pass
    assert meter.per_file(0) == {}
