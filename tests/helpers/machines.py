"""A machine with accelerators this one does not have, as PyTorch Lightning's suite mocks
them: what torch says of the machine -- ``torch.accelerator``, ``torch.cuda`` /
``torch.xpu`` / ``torch.backends.mps`` availability and device counts, and through them
DataParallel's own view of the machine -- answers as that machine would. What the code
decides from it (``--device auto``, its refusals, a process's device and its group's
backend, where DataParallel puts the model) can then be tested here; no kernel runs on the
pretended device."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

KINDS = ("cuda", "xpu", "mps")


def pretend_machine(monkeypatch, kind: Optional[str], count: int = 1) -> None:
    """This machine as one with ``count`` accelerators of ``kind`` (None: none, a CPU box)."""
    if kind not in (None, *KINDS):
        raise ValueError(kind)
    found = torch.device(kind) if kind else None
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: found)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: found is not None)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if found else 0)
    for name, module in (("cuda", torch.cuda), ("xpu", torch.xpu), ("mps", torch.mps)):
        n = count if kind == name else 0
        monkeypatch.setattr(module, "device_count", lambda n=n: n)
        if name != "mps":
            monkeypatch.setattr(module, "is_available", lambda n=n: n > 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: kind == "mps")
    # What torch asks of the accelerator on its own (an optimizer's step checks that no
    # CUDA graph is being captured on the current stream): an idle device.
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "current_stream",
                        lambda device=None: SimpleNamespace(is_capturing=lambda: False))
