"""A device's rules, checked on the CPU: what a run does that MPS or CUDA would not take.

``device_rules("mps")`` / ``device_rules("cuda")`` is a context manager around code that runs
on the CPU here (a script's ``main``, a set-up, an epoch, an evaluation). It watches every op
the dispatcher runs (a ``TorchDispatchMode``) and every call the code makes on tensors (a
``TorchFunctionMode``: a copy between two CPU tensors dispatches nothing, so a copy is seen
where it is called), and follows which tensors would live on the device: what a copy sends
there (``.to(device)``), what a factory makes there (``device=``), what ``on_device`` names,
and whatever an op computes from them. The rest is host memory. It records each breach:

- MPS: no float64 tensor from the project's calls (MPS has none: "Cannot convert a MPS
  Tensor to float64 dtype"; torch's own code picks its ops per device); no
  ``non_blocking=True`` copy from pageable host memory (MPS may read it after it is freed:
  a silently wrong input).
- CUDA: within ``rules.window()`` (an epoch's steps, an evaluation) no host sync on a device
  tensor -- ``.item()``, ``.tolist()``, ``.cpu()``, a truth value -- outside the engine's
  ``HOST_READ`` spans, where it reads every ``log_every`` steps; every copy between host
  and device from pinned memory (from pageable memory the host waits for it, or a
  non-blocking one races the memory's reuse). Pinned memory is emulated: what the code pins
  (``pin_memory()``, ``pin_memory=True``, a DataLoader's pinning) is recorded and answers
  ``is_pinned()`` as on a GPU machine (``as_on_cuda`` makes the code pin where it would).

A breach is one line: the rule, what broke it and the project's line that made it
(``rules.breaches``; ``rules.float64`` counts the float64 tensors).
"""
from __future__ import annotations

import contextlib
import os
import traceback
import weakref
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.processes import AMP_DIR

# The name of the engine's host reads (ampkit.device.HOST_READ), where a sync is the point.
HOST_READ = "ampkit: host read"
SYNC_OPS = {"aten::_local_scalar_dense"}  # .item(), a truth value, int()/float()
SYNC_CALLS = {"tolist", "cpu"}            # no op on a CPU tensor: seen where called
COPY_CALLS = {"to", "copy_", "cuda", "xpu", "mps"}
# What stands between a call and a mode's handler on the stack: torch's machinery of modes.
_MODE_MACHINERY = ("_compile.py", "eval_frame.py", "_python_dispatch.py", "overrides.py")


def _frames() -> list:
    """The stack outside this file and torch's machinery of modes, innermost last."""
    return [f for f in traceback.extract_stack()[:-2] if f.filename != __file__
            and not (f"{os.sep}torch{os.sep}" in f.filename
                     and f.filename.endswith(_MODE_MACHINERY))]


def _called_by_torch() -> bool:
    """Whether the op or call being watched comes from torch's own code."""
    frames = _frames()
    return bool(frames) and f"{os.sep}torch{os.sep}" in frames[-1].filename


def _called_by_a_library() -> bool:
    """Whether the call comes from an installed library other than torch (torchvision's
    transforms, which run on the host)."""
    frames = _frames()
    return bool(frames) and "-packages" in frames[-1].filename and \
        f"{os.sep}torch{os.sep}" not in frames[-1].filename


def _where() -> str:
    """The innermost line of the project's code on the stack (the call that broke a rule),
    else the innermost line outside torch."""
    frames = _frames()
    for frame in reversed(frames):
        if Path(frame.filename).resolve().is_relative_to(AMP_DIR):
            return f"{Path(frame.filename).resolve().relative_to(AMP_DIR.parent)}:{frame.lineno}"
    for frame in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


def _tensors(*trees) -> List[torch.Tensor]:
    """The tensors in ``trees`` (an op's arguments: tensors, lists and tuples of them)."""
    found, todo = [], list(trees)
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return found


class _Ops(TorchDispatchMode):
    """Every op the dispatcher runs: where its outputs live, float64, host syncs, spans."""

    def __init__(self, rules: "DeviceRules") -> None:
        super().__init__()
        self.rules = rules
        self.spans: List[str] = []  # the names of the profiler's spans open now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        out = func(*args, **kwargs)
        rules, inputs = self.rules, _tensors(args, kwargs)
        outputs = _tensors(out)
        # The spans nest (each a ``with``): an exit closes the last one opened.
        if name == "profiler::_record_function_enter_new":
            self.spans.append(args[0] if args else "")
        elif name == "profiler::_record_function_exit" and self.spans:
            self.spans.pop()
        # Where the outputs live matters to CUDA's rules (MPS's copies are all the host's).
        if rules.kind == "cuda" and outputs and any(rules.on(t) for t in inputs):
            rules.on_device(*outputs)
        if rules.kind == "mps" and any(t.dtype == torch.float64
                                       for t in inputs + outputs) and not _called_by_torch():
            rules.float64 += 1
            rules.breach(f"a float64 tensor in {name} (MPS has no float64)")
        if rules.kind == "cuda" and name in SYNC_OPS and rules.on(inputs[0]):
            rules.sync(name, in_read=HOST_READ in self.spans)
        return out


class _Calls(TorchFunctionMode):
    """Every call the code makes on tensors: copies, factories, pinning, syncs."""

    def __init__(self, rules: "DeviceRules") -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        rules = self.rules
        if rules.kind == "cuda" and name == "is_pinned":
            return rules.is_pinned(args[0])
        if rules.kind == "cuda" and name == "pin_memory":
            return rules.pin(args[0].clone())
        if rules.kind == "cuda" and kwargs.get("pin_memory"):  # empty(..., pin_memory=True)
            del kwargs["pin_memory"]
            return rules.pin(func(*args, **kwargs))
        copied = name in COPY_CALLS and args and isinstance(args[0], torch.Tensor)
        if copied and not _called_by_torch():  # torch's own copies are its (GradScaler's)
            rules.copy(name, args, kwargs)
        if rules.kind == "cuda" and name in SYNC_CALLS and rules.on(args[0]):
            rules.sync(f"Tensor.{name}()", in_read=HOST_READ in rules.ops.spans)
        out = func(*args, **kwargs)
        to_device = (name in ("to", "cuda", "xpu", "mps") and copied and
                     (name != "to" or torch._C._nn._parse_to(
                         *args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})[0]
                      is not None))
        made_there = (kwargs.get("device") is not None and isinstance(out, torch.Tensor)
                      and not _called_by_a_library())
        if to_device or made_there:
            rules.on_device(out)  # a copy to the device, a factory's tensor made there
        return out


class DeviceRules:
    """The rules of ``kind`` ("mps" or "cuda"), watched while the ``with`` lasts."""

    def __init__(self, kind: str) -> None:
        if kind not in ("mps", "cuda"):
            raise ValueError(kind)
        self.kind = kind
        self.breaches: List[str] = []
        self.float64 = 0
        self.in_window = False
        self._pinned: Dict[int, torch.Tensor] = {}  # storage address -> the pinned tensor
        self._device: Dict[int, weakref.ref] = {}    # id -> a tensor on the device
        self.ops = _Ops(self)

    # -- where a tensor lives
    def on_device(self, *things) -> None:
        """These tensors (a module: its parameters and buffers) live on the device."""
        for thing in things:
            tensors = ([*thing.parameters(), *thing.buffers()] if isinstance(thing, nn.Module)
                       else _tensors(thing))
            for t in tensors:
                key = id(t)
                self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def on(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        self._pinned[t.untyped_storage().data_ptr()] = t
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.kind == "cuda" and t.untyped_storage().data_ptr() in self._pinned

    # -- the rules
    def breach(self, what: str) -> None:
        line = f"{self.kind.upper()} rule: {what}, at {_where()}"
        if line not in self.breaches:
            self.breaches.append(line)

    def sync(self, what: str, in_read: bool) -> None:
        if self.in_window and not in_read:
            self.breach(f"a host sync ({what}) in a step, outside the engine's host reads")

    def copy(self, name: str, args: tuple, kwargs: dict) -> None:
        """A copy the code asks for: ``to(device)``, ``cuda()``, ``dst.copy_(src)``."""
        if name == "copy_":
            dst, src = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            host = src if not self.on(src) and self.on(dst) else (
                dst if self.on(src) and not self.on(dst) else None)
        else:
            to = {k: v for k, v in kwargs.items() if k != "copy"}
            device, _, non_blocking, _ = (torch._C._nn._parse_to(*args[1:], **to)
                                          if name == "to" else (True, None, False, None))
            if name != "to":
                non_blocking = kwargs.get("non_blocking", False)
            host = args[0] if device is not None and not self.on(args[0]) else None
        if host is None:  # between two host tensors, or on the device
            return
        if non_blocking and not self.is_pinned(host):
            self.breach(f"a non_blocking copy (Tensor.{name}) from pageable memory")
        elif self.kind == "cuda" and self.in_window and not self.is_pinned(host):
            self.breach(f"a copy between host and device (Tensor.{name}) from pageable "
                        "memory in a step")

    @contextlib.contextmanager
    def window(self) -> Iterator["DeviceRules"]:
        """An epoch's steps or an evaluation: where CUDA takes no host sync but the host
        reads, and every copy between host and device is from pinned memory."""
        self.in_window = True
        try:
            yield self
        finally:
            self.in_window = False

    def __enter__(self) -> "DeviceRules":
        self._calls = _Calls(self)
        self._calls.__enter__()
        self.ops.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.ops.__exit__(*exc)
        self._calls.__exit__(*exc)


def device_rules(kind: str) -> DeviceRules:
    return DeviceRules(kind)


@contextlib.contextmanager
def as_on_cuda(monkeypatch) -> Iterator[None]:
    """The code pins where it would on a CUDA machine: on a machine with a GPU
    (``helpers.machines``), ampkit's ``pinned()`` says yes for the run's device, and a
    DataLoader with ``pin_memory=True`` pins its batches."""
    import sys

    from ampkit import device as device_module
    from helpers.machines import pretend_machine

    def pinned(device: torch.device) -> bool:
        return True

    original = device_module.pinned
    for module in list(sys.modules.values()):  # every module that took it by name
        if getattr(module, "pinned", None) is original:
            monkeypatch.setattr(module, "pinned", pinned)
    pretend_machine(monkeypatch, "cuda", 1)
    yield


def one_line(breaches: List[str]) -> Optional[str]:
    """The breaches, for an assertion's message (None: none)."""
    return "\n".join(breaches) or None
