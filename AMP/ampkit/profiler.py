"""``torch.profiler`` over training steps, for ``--profile``: a Chrome trace per rank and the
operators that took the most time."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile, schedule


# The steps it takes: 1 skipped, 1 warm-up (the profiler's own start-up, recorded and
# dropped), 3 traced.
WAIT, WARMUP, ACTIVE = 1, 1, 3
STEPS = WAIT + WARMUP + ACTIVE


class StepProfiler:
    """``torch.profiler`` over :data:`STEPS` training steps; then the Chrome trace is written
    to ``path`` and ``table`` holds the top operators by self time; ``say`` prints
    :meth:`report` at the end."""

    def __init__(self, path: Path, device: torch.device,
                 say: Optional[Callable[[str], None]] = None) -> None:
        self.say = say
        self.path, self.needed, self.table = Path(path), STEPS, ""
        # The device's own activity where the profiler has one (CUDA, XPU, MPS).
        device_activity = getattr(ProfilerActivity, device.type.upper(), None)
        self.on_device = (device.type != "cpu"
                          and device_activity in torch.profiler.supported_activities())
        activities = [ProfilerActivity.CPU] + ([device_activity] if self.on_device else [])
        # One recording cycle: acc_events changes nothing but the warning torch 2.11 gives.
        self.prof = profile(activities=activities, on_trace_ready=self._ready, acc_events=True,
                            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1))

    def _ready(self, prof) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        sort = "self_device_time_total" if self.on_device else "self_cpu_time_total"
        self.table = prof.key_averages().table(sort_by=sort, row_limit=12)

    def __enter__(self) -> "StepProfiler":
        self.prof.start()
        return self

    def step(self) -> None:
        self.prof.step()

    def __exit__(self, *exc) -> None:
        self.prof.stop()
        if self.say is not None and exc[0] is None:
            self.say(self.report())

    def report(self) -> str:
        """What to print once the steps are over."""
        if not self.table:
            return (f"--profile: fewer than the {self.needed} steps it records "
                    "(1 skipped, 1 warm-up, 3 traced): no trace written (more steps: a "
                    "smaller --batch_size)")
        return (f"{self.table}\ntrace: {self.path} (open it in https://ui.perfetto.dev or "
                "chrome://tracing)")
