"""A run's checkpoints: where it stands (:mod:`.progress`), loading and saving them from its start
to its end (:mod:`.manager`), writing them atomically in the background (:mod:`.writer`), reading
them safely (:mod:`.files`) and checking what they hold (:mod:`.validate`)."""
from .files import BEST, LAST
from .manager import CheckpointManager
from .progress import Progress

__all__ = ["BEST", "LAST", "CheckpointManager", "Progress"]
