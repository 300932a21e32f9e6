"""Where the run stands: one more entry of a script's checkpointed ``state``, saved and loaded
by its ``state_dict()`` / ``load_state_dict()`` like the model's and the optimizer's."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .validate import is_number, is_whole, shown


@dataclass
class Progress:
    """The epochs done; the optimizer steps done of the next one (a stop mid-epoch: the
    script starts it there, and ``so_far`` holds its figures up to the stop, which the meters
    add to the rest); the best validation accuracy and its epoch (-1: none yet), and the
    last epoch's. The checkpoint manager moves it on as it saves."""
    epoch: int = 0
    step: int = 0
    best_acc: float = -1.0
    best_epoch: int = -1
    val_acc: Optional[float] = None
    so_far: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """``saved``, checked: a file edited by hand or damaged into another valid one is a
        ValueError naming the field, not a run that goes on from a value it cannot have (a
        NaN best accuracy, which no epoch ever beats)."""
        for name, fits in _RULES.items():
            if name in saved and not fits(saved[name]):
                raise ValueError(f"its {name!r} is {shown(saved[name])}")
        known = {f.name for f in dataclasses.fields(self)}
        for name, value in saved.items():
            if name in known:
                setattr(self, name, value)

    def ended_epoch(self, epoch: int, val_acc: float) -> None:
        """``epoch`` epochs are done, the last validated at ``val_acc``."""
        self.epoch, self.step, self.so_far, self.val_acc = epoch, 0, None, val_acc
        if val_acc > self.best_acc:
            self.best_acc, self.best_epoch = val_acc, epoch

    def stopped(self, step: int, so_far: Optional[Dict[str, Any]]) -> None:
        """A stop ``step`` steps into epoch ``epoch`` + 1 (0: at its start), with its figures."""
        self.step, self.so_far = step, so_far if step else None


_RULES = {
    "epoch": lambda v: is_whole(v, 0), "step": lambda v: is_whole(v, 0),
    "best_epoch": lambda v: is_whole(v, -1),
    "best_acc": lambda v: is_number(v) and -1 <= v <= 1,
    "val_acc": lambda v: v is None or (is_number(v) and 0 <= v <= 1),
    "so_far": lambda v: v is None or (isinstance(v, dict) and all(
        isinstance(k, str) and (is_number(x) or x is None) for k, x in v.items())),
}
