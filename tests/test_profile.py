"""--profile: a torch.profiler trace of a few steps after warm-up, per rank, that opens in
Perfetto (Chrome's trace JSON), and the top operators by self time."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_args

# Each test runs the profiler over real steps (a few seconds each): the full suite's.
pytestmark = pytest.mark.slow


def _trace_events(path: Path) -> list:
    trace = json.loads(path.read_text())  # Perfetto and chrome://tracing read this JSON
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def test_train_profile_writes_a_trace_and_prints_the_top_operators(imagefolder_root, tmp_path,
                                                                   capsys):
    import train_without

    # 48 images in batches of 8: 6 steps, enough for 1 skipped + 1 warm-up + 3 traced.
    train_without.main(tiny_args(tmp_path, imagefolder_root, batch_size=8)
                       + ["--arch", "resnet18", "--profile"])
    out = capsys.readouterr().out
    trace = tmp_path / "checkpoint" / "train_without" / "profile" / "trace_rank0.json"
    events = _trace_events(trace)
    names = {e["name"] for e in events}
    assert any("convolution" in n for n in names) and any("ProfilerStep" in n for n in names)
    assert sum("ProfilerStep" in n for n in names) == 3  # the traced steps, no more
    assert "Self CPU" in out and f"trace: {trace}" in out and "ui.perfetto.dev" in out, out


def test_benchmark_profile_traces_each_variant(tmp_path, capsys, monkeypatch):
    import benchmark

    args = benchmark.parse_args(["--no-cuda", "--variants", "train_without", "--arch",
                                 "resnet18", "--img_size", "64", "--batch_size", "2", "--steps",
                                 "1", "--warmup", "0", "--pipeline", "none", "--profile"])
    monkeypatch.setattr(benchmark, "parse_args", lambda argv=None: args)
    args.profile_dir = tmp_path / "profile"
    assert benchmark.main() == 0
    assert _trace_events(tmp_path / "profile" / "train_without" / "trace_rank0.json")
    assert "Self CPU" in capsys.readouterr().out


def test_too_few_steps_to_profile_says_so(imagefolder_root, tmp_path, capsys):
    import train_without

    train_without.main(tiny_args(tmp_path, imagefolder_root, batch_size=48)  # one step
                       + ["--arch", "resnet18", "--profile"])
    out = capsys.readouterr().out
    assert "--profile: fewer than the 5 steps" in out, out
    assert not (tmp_path / "checkpoint" / "train_without" / "profile").exists()
