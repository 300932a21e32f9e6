"""checks/gpu_check.sh's step runner (checks/gpu_check_steps.sh): a step stopped by its timeout leaves no
process behind; what comes back is one summary and one small archive (no checkpoint in it);
a step that fails or is skipped makes the check fail, and the summary's last line names it."""
from __future__ import annotations

import os
import tarfile
import time
from pathlib import Path

import pytest

from helpers.processes import PYTHON, ScriptResult, run

# A step that starts a child in a new session (as tests/helpers/processes.py's start does), which would
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


@pytest.mark.slow  # a step of two processes, stopped by its timeout
def test_a_step_stopped_by_its_timeout_leaves_no_process(tmp_path):
    out, work, pidfile = tmp_path / "out", tmp_path / "work", tmp_path / "pid"
    out.mkdir()
    work.mkdir()
    (tmp_path / "step.py").write_text(STEP)
    script = (f'OUT={out} WORK={work} BUDGET=3 MIN_STEP=1; source checks/gpu_check_steps.sh; '
              f'run slow 60 {PYTHON} {tmp_path / "step.py"} {pidfile}; echo "rc=$?"')
    t0 = time.monotonic()
    res = run(["bash", "-c", script], timeout=60)
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
    assert "slow: FAILED rc=124" in (out / "summary.txt").read_text()
    with tarfile.open(out / "details.tar.gz") as tar:
        assert "./slow.txt" in tar.getnames()


def _steps(tmp_path, body: str, **env) -> ScriptResult:
    """Run ``body`` in bash with checks/gpu_check_steps.sh sourced (OUT, WORK under tmp_path)."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    settings = " ".join(f"{k}={v}" for k, v in {"BUDGET": 60, "MIN_STEP": 1, **env}.items())
    script = f"OUT={out} WORK={work} {settings}; source checks/gpu_check_steps.sh; {body}"
    return run(["bash", "-c", script], timeout=60)


def test_a_failed_or_skipped_step_makes_the_check_fail_and_is_named_last(tmp_path):
    res = _steps(tmp_path, 'run good 30 true; run bad 30 sh -c "exit 3"; run after 30 true; '
                           'needs "$WORK/none.pth" eval_none && run eval_none 30 true; '
                           'finish; echo "finish=$?"')
    assert "finish=1" in res.stdout, res.stdout + res.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert "bad: FAILED rc=3" in "\n".join(summary)
    last = summary[-1]  # every step ran; the failed and the skipped ones are listed last
    assert "2 steps passed" in last and "FAILED: bad(rc=3) eval_none(skipped: " in last, last
    assert "good" not in last.split("FAILED:")[1] and "after" not in last.split("FAILED:")[1]


def test_all_steps_passing_finish_with_status_zero(tmp_path):
    res = _steps(tmp_path, "run one 30 true; run two 30 echo hi; finish; echo finish=$?")
    assert "finish=0" in res.stdout, res.stdout + res.stderr
    last = (tmp_path / "out" / "summary.txt").read_text().splitlines()[-1]
    assert "2 steps passed; no step failed" in last and "details.tar.gz" in last, last


def test_big_files_stay_out_of_the_archive_and_long_outputs_are_cut(tmp_path):
    """A checkpoint left in WORK is not packed (and named in the summary); a step's long
    output is cut to its head and tail, so it is still packed; a file under OUT bigger than
    OUT_MAX_KB fails the check."""
    res = _steps(tmp_path, 'head -c 300000 /dev/zero > "$WORK/last.pth"; '
                           'run chatty 30 sh -c "yes line | head -n 100000; echo the end"; '
                           'finish; echo "finish=$?"; '
                           'head -c 300000 /dev/urandom > "$OUT/extra.bin"; finish; echo "finish=$?"',
                 PACK_MAX_KB=100, OUT_MAX_KB=200)
    assert res.stdout.count("finish=") == 2, res.stdout + res.stderr
    first, second = [line for line in res.stdout.splitlines() if line.startswith("finish=")]
    assert first == "finish=0" and second == "finish=1", res.stdout
    with tarfile.open(tmp_path / "out" / "details.tar.gz") as tar:
        names = tar.getnames()
        chatty = tar.extractfile("./chatty.txt").read().decode()
    assert "./last.pth" not in names and "./steps.tsv" in names
    assert len(chatty) <= 100 * 1024 and "bytes cut ...]" in chatty
    assert chatty.startswith("line\n") and chatty.endswith("the end\nrc=0\n")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "left out of details.tar.gz (over 100 KiB): ./last.pth" in summary
    assert "1 over 200 KiB" in summary.splitlines()[-1]


def test_gpu_check_script_parses():
    res = run(["bash", "-n", "checks/gpu_check.sh"], timeout=30)
    assert res.returncode == 0, res.stderr


def test_gpu_check_runs_correctness_first_then_timings_then_compile():
    """The one GPU try must first say whether the CUDA paths are right: the CUDA tests run
    first, then the short runs of every path, then the timings; a step with --compile (or
    the busy shares, which compile) comes after every other, so a compile that hangs or
    runs long costs no answer before it."""
    import re

    text = Path("checks/gpu_check.sh").read_text()
    steps = [(m.group(1), m.group(2)) for m in re.finditer(
        r"^\s*(?:needs \S+ \S+ &&\s*)?run (\w+) \d+ (.*(?:\\\n.*)*)", text, re.M)]
    names = [name for name, _ in steps]
    assert names[0] == "pytest_cuda", names
    compiled = [i for i, (name, cmd) in enumerate(steps)
                if "--compile" in cmd or name.startswith("busy_")]
    timings = [i for i, (name, _) in enumerate(steps)
               if name.startswith("bench_") or name in ("real_run", "pipeline")]
    correctness = [i for i in range(len(steps)) if i not in compiled + timings]
    assert compiled and timings and len(correctness) >= 10, names
    assert max(correctness) < min(timings) and max(timings) < min(compiled), names
