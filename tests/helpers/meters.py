"""The run's meters for a test's loop over batches, outside a run: the same ``Meters`` a
script makes, over stand-in data (``tools.step_throughput.SyntheticData``), with nothing said
and no FLOPs counted."""
from __future__ import annotations

from typing import Optional

import torch

from ampkit.distributed import DistInfo
from ampkit.meters import Meters
from tools.step_throughput import SyntheticData, step_meters


def meters_of(technique, info: Optional[DistInfo] = None) -> Meters:
    info = info or DistInfo(device=torch.device("cpu"))
    return step_meters(technique, info, SyntheticData(1, 10, (3, 16, 16)), arch=None)
