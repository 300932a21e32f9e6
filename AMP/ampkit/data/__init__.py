"""A run's data: the data sets (:mod:`.datasets`: CIFAR-10, ImageFolder, FakeData), the order
they are read in (:mod:`.samplers`), the two input paths -- the whole data set on the
device (:mod:`.on_device`) or torchvision's DataLoader (:mod:`.classic`) -- and the loaders
a script takes (:mod:`.loaders`)."""
from .loaders import Loaders, build_loaders, report_unreadable

__all__ = ["Loaders", "build_loaders", "report_unreadable"]
