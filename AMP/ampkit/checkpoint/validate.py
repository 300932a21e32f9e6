"""What a checkpoint must hold to be loaded: the run's record of the right kinds and ranges,
and each saved state fitting the object it is loaded into. A file edited by hand, damaged
into another valid pickle, or written by something else is then one line, before any value
of it is used -- not a traceback an epoch later, and not a run that goes on from values it
cannot have (a NaN best accuracy no epoch ever beats)."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Tuple

import torch

from ..distributed import IMPLEMENTATION_FLAGS


def is_whole(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def is_number(v: Any) -> bool:
    """An int or float, not a bool, not NaN."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _whole(low: int) -> Tuple[str, Callable[[Any], bool]]:
    return f"a whole number >= {low}", lambda v: is_whole(v, low)


def _streams(saved: Any) -> bool:
    """A list of ranks' random streams (an older checkpoint: rank 0's dict alone), each with
    the CPU generator's state."""
    ranks = [saved] if isinstance(saved, dict) else saved
    return isinstance(ranks, list) and all(
        isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor)
        and r["torch"].dtype == torch.uint8 and r["torch"].dim() == 1 for r in ranks)


_TEXT = ("text", lambda v: isinstance(v, str))
_PLAIN = (str, int, float, bool, type(None))
# What the run was, each field where a checkpoint has it (an older one lacks some), and what
# only a resume reads (files.RESUMING); where it stands is its Progress entry's, which checks
# its own.
RECORD_RULES: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "num_classes": _whole(1), "world_size": _whole(1),
    "arch": _TEXT, "variant": _TEXT, "torch_version": _TEXT,
    "args": ("the run's flags (a dict of plain values)",
             lambda v: isinstance(v, dict) and all(isinstance(x, _PLAIN) for x in v.values())),
    "rng": ("each rank's random streams", _streams),
    "best_model": ("weights (a dict of tensors)",
                   lambda v: isinstance(v, dict) and all(isinstance(x, torch.Tensor)
                                                         for x in v.values())),
}
# The recorded flags that are read back as numbers: a resume compares them, an eval uses them.
FLAG_RULES = {"img_size": _whole(1), "batch_size": _whole(1), "accum_steps": _whole(1),
              "train_subset": ("a whole number >= 1, or None",
                               lambda v: v is None or is_whole(v, 1)),
              "lr": ("a number >= 0, or None", lambda v: v is None or (is_number(v) and v >= 0)),
              "dataset": _TEXT, "dataset_root": _TEXT, "arch": _TEXT}


def record_fault(ckpt: Mapping[str, Any]) -> str:
    """What of ``ckpt``'s record is not what a run writes, in words ("" if nothing)."""
    for name, (kind, fits) in RECORD_RULES.items():
        if name in ckpt and not fits(ckpt[name]):
            return f"its {name!r} is {shown(ckpt[name])}, not {kind}"
    flags = ckpt.get("args") or {}
    for name, (kind, fits) in FLAG_RULES.items():
        if name in flags and not fits(flags[name]):
            return f"its recorded --{name} is {shown(flags[name])}, not {kind}"
    return ""


def shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def misfit(saved: Any, live: Any, where: str = "") -> str:
    """Where ``saved`` (a state dict) does not fit ``live`` (the object's own): a value of
    another kind where the live one has a tensor, a number, a flag, text, a dict or a list
    (lists of the same length: they follow the param groups), or a NaN number; a flag may
    be None (unset). Keys only one side has are left to the object's ``load_state_dict``
    (an older or newer version)."""
    at = where or "it"
    if isinstance(live, torch.Tensor):
        return "" if isinstance(saved, torch.Tensor) else f"{at} is {shown(saved)}, not a tensor"
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return f"{at} is {shown(saved)}, not a dict"
        return next((why for key in live.keys() & saved.keys()
                     if (why := misfit(saved[key], live[key], f"{where}[{key!r}]"))), "")
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            return f"{at} is {shown(saved)}, not {len(live)} values"
        return next((why for i, (s, v) in enumerate(zip(saved, live))
                     if (why := misfit(s, v, f"{where}[{i}]"))), "")
    if isinstance(live, bool):
        # torch's optimizers write an unset Optional[bool] flag (fused, foreach) as None.
        return "" if isinstance(saved, bool) or saved is None else \
            f"{at} is {shown(saved)}, not True, False or None"
    if isinstance(live, (int, float)):
        return "" if is_number(saved) else f"{at} is {shown(saved)}, not a number"
    if isinstance(live, str):
        return "" if isinstance(saved, str) else f"{at} is {shown(saved)}, not text"
    return ""


def optimizer_misfit(saved: Any, optimizer: torch.optim.Optimizer) -> str:
    """Where an optimizer's saved state does not fit ``optimizer``: its groups' settings as
    :func:`misfit` has them, each number of them there (``load_state_dict`` fills in a
    missing flag, not a missing rate); its groups name as many parameters as the live ones
    hold, in order (by index, or over FSDP2 by name); every parameter's state holds the
    same entries, tensors that are scalars or of that parameter's shape (its moments, say),
    its step perhaps a number."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    per_param = saved.get("state", {}) if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
            and isinstance(per_param, dict)):
        return "it is not an optimizer's state (a dict of 'state' and 'param_groups')"
    # How it was built to run is the live optimizer's own (load_optimizer_state keeps it).
    settings = lambda gs: [{k: v for k, v in g.items()  # noqa: E731
                            if k not in ("params", *IMPLEMENTATION_FLAGS)} for g in gs]
    why = misfit(settings(groups), settings(optimizer.param_groups), "['param_groups']")
    missing = [f"['param_groups'][{i}][{key!r}]" for i, (group, live) in
               enumerate(zip(groups, optimizer.param_groups)) for key, value in live.items()
               if key not in group and (is_number(value) or isinstance(value, tuple))]
    if why or missing:
        return why or f"{missing[0]} is missing"
    names = [name for group in groups for name in group.get("params", [])]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(names) != len(params):
        return f"it holds {len(names)} parameters, this run's optimizer {len(params)}"
    shapes = dict(zip(names, (p.shape for p in params)))
    entries = sorted({tuple(sorted(map(str, v))) for v in per_param.values()
                      if isinstance(v, dict)})
    if len(entries) > 1:
        return f"its parameters' states hold different entries: {entries[0]}, {entries[1]}"
    # An entry is each parameter's scalar (a step) or each one's tensor of its shape (a
    # moment): one of another shape would reach the optimizer's kernels (a fused AdamW
    # crashes the process on a scalar moment).
    scalar: Dict[str, set] = {}
    for name, values in per_param.items():
        if name not in shapes or not isinstance(values, dict):
            return f"['state'][{name!r}] is not the state of one of its parameters"
        for key, value in values.items():
            at = f"['state'][{name!r}][{key!r}]"
            if not isinstance(value, torch.Tensor) and not (key == "step" and is_number(value)):
                return f"{at} is {shown(value)}, not a tensor"
            dim = value.dim() if isinstance(value, torch.Tensor) else 0
            if dim and value.shape != shapes[name]:
                return f"{at} has shape {tuple(value.shape)}, its parameter {tuple(shapes[name])}"
            scalar.setdefault(key, set()).add(dim == 0 and shapes[name] != ())
    mixed = [key for key, kinds in scalar.items() if len(kinds) > 1]
    return f"['state'][...][{mixed[0]!r}] is a scalar for some parameters only" if mixed else ""
