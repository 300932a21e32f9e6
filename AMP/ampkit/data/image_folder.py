"""ImageFolder (``<root>/<split>/<class>/*``) read as its tree holds: torchvision's, whose
unreadable images become :class:`Unreadable` samples (the classic loader names them, or passes
over them), and the faults of a tree that torchvision's walk passes over without a word
(:func:`tree_problem`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torchvision
from PIL import Image, UnidentifiedImageError
from torchvision.datasets.folder import IMG_EXTENSIONS


@dataclass(frozen=True)
class Unreadable:
    """Stands in a sample for an image that could not be read: its path, and why."""
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


class ImageFolder(torchvision.datasets.ImageFolder):
    """torchvision's ImageFolder whose unreadable images become :class:`Unreadable` samples:
    raised inside a DataLoader worker, their error would reach the user as a traceback,
    without the file's name in its last line."""

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        try:
            with open(path, "rb") as f:
                # convert() decodes it all: a truncated file fails here, inside the try.
                image = Image.open(f).convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            reason = ("not an image file PIL can read" if isinstance(e, UnidentifiedImageError)
                      else e.strerror if isinstance(e, PermissionError)
                      else (str(e).splitlines() or [type(e).__name__])[0])
            return Unreadable(path, reason), target
        return (self.transform(image) if self.transform else image), target


def tree_problem(folder: str) -> Optional[str]:
    """What torchvision's walk of ``folder`` would pass over without a word, in a line: a link
    back up the tree (followed again and again, each image a sample anew), an image outside
    any class folder (left out); None if nothing. An unreadable folder, which it passes over
    too, raises its PermissionError here."""
    seen = set()
    for path, dirs, files in os.walk(folder, followlinks=True):
        for name in dirs:
            os.scandir(os.path.join(path, name)).close()
        real = os.path.realpath(path)
        if real in seen:
            return (f"{path}: leads to {real}, read already (a link): its images would be read "
                    "again and again; remove the link")
        seen.add(real)
        loose = [f for f in files if f.lower().endswith(IMG_EXTENSIONS)]
        if path == folder and loose:
            return (f"{os.path.join(folder, loose[0])}: an image outside any class folder: move "
                    f"it into its class's folder, {folder}/<class>/")
    return None
