"""A run's checkpoints: what they hold and when they are written (:mod:`.saver`), writing them
atomically in the background (:mod:`.writer`), reading them safely (:mod:`.files`), and
resuming from one (:mod:`.resume`)."""
from .files import BEST, LAST
from .resume import Resumed, restore, resume
from .saver import Saver

__all__ = ["BEST", "LAST", "Resumed", "Saver", "restore", "resume"]
