"""bench/gpu_check.sh's step runner (bench/steps.sh): a step stopped by its timeout leaves no
process behind, and what comes back is one summary and one archive."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from conftest import REPO_ROOT

# A step that starts a child in a new session (as conftest.run_script does), which would
# outlive the step's timeout; the child writes its pid, then both sleep.
STEP = """
import subprocess, sys, time
child = subprocess.Popen(["sleep", "300"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its exit status is left


def test_a_step_stopped_by_its_timeout_leaves_no_process(tmp_path):
    out, work, pidfile = tmp_path / "out", tmp_path / "work", tmp_path / "pid"
    out.mkdir()
    work.mkdir()
    (tmp_path / "step.py").write_text(STEP)
    script = (f'OUT={out} WORK={work} BUDGET=3 MIN_STEP=1; source bench/steps.sh; '
              f'run slow 60 {sys.executable} {tmp_path / "step.py"} {pidfile}; echo "rc=$?"')
    t0 = time.monotonic()
    res = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60)
    assert time.monotonic() - t0 < 30, "the step's timeout was not applied"
    assert "rc=124" in res.stdout, res.stdout + res.stderr
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):  # clean up before failing
        os.kill(pid, 9)
        raise AssertionError("the step's detached child outlived the step")
    # What the device tool brings back: the summary and one archive of the details.
    assert sorted(p.name for p in out.iterdir()) == ["details.tar.gz", "summary.txt"]
    assert "slow: rc=124" in (out / "summary.txt").read_text()
    with tarfile.open(out / "details.tar.gz") as tar:
        assert "./slow.txt" in tar.getnames()
