"""The networks: which one a run trains (``--arch``: any torchvision classifier by builder
name; ``alexnet`` has the layers of the article's ``AMP/alexnet.py``, whose weights load into
each other), the checks that a name exists and takes the run's image size (made before
anything is built, on the meta device), the network built from ``--seed`` alone (the same
initial weights on every rank, for any world size), autocast in what DataParallel
replicates, the blocks FSDP2 shards one by one, ``--compile``, and the FLOPs of a training
image (:func:`training_flops_per_image`: a forward and backward on the meta device, counted
by PyTorch's ``FlopCounterMode``; matmuls and convolutions, not the optimizer, normalisation
or activations, a rounding error of a CNN's work)."""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch
import torchvision
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from .distributed import DistInfo
from .errors import UserError
from .randomness import seed_streams


DEFAULT_ARCH = "alexnet"
# AlexNet's features shrink a smaller input below the 3x3 kernel of their last max-pool.
MIN_ALEXNET_SIZE = 63


@functools.lru_cache(maxsize=1)
def arch_names() -> List[str]:
    """Every torchvision classification model's builder name."""
    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_arch(arch: str) -> None:
    if arch not in arch_names():
        raise UserError(f"unknown --arch {arch!r}: --arch list prints the {len(arch_names())} "
                        "torchvision classifiers it takes (resnet18, resnet50, vit_b_16, ...)")


def builder_kwargs(arch: str) -> dict:
    """Keyword arguments that make any classifier a plain one: one output tensor in training
    (no auxiliary logits) and no warning about a default that will change."""
    params = inspect.signature(torchvision.models.get_model_builder(arch)).parameters
    kwargs = {}
    if "aux_logits" in params or arch in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False
    if arch in ("googlenet", "inception_v3"):
        kwargs["init_weights"] = True
    return kwargs


def check_input_size(arch: str, img_size: int) -> None:
    """One line if ``arch`` cannot take ``img_size`` x ``img_size`` images (checked by a forward
    pass on the meta device: shapes only, no memory, no arithmetic)."""
    if arch == DEFAULT_ARCH:
        if img_size < MIN_ALEXNET_SIZE:
            raise UserError(f"--img_size must be at least {MIN_ALEXNET_SIZE} for AlexNet, "
                            f"got {img_size}")
        return
    reason = _meta_forward_problem(arch, img_size)
    if reason is not None and _meta_forward_problem(arch, 224) is None:
        raise UserError(f"--img_size {img_size} does not suit --arch {arch}: {reason}")


def check_batch_of_one(arch: str, img_size: int) -> None:
    """``--batch_size 1`` in training: one line if ``arch`` cannot train on one image of
    ``img_size`` px (BatchNorm over a 1 x 1 map normalises one value a channel)."""
    reason = _meta_forward_problem(arch, img_size, batch=1, train=True)
    if reason is not None:
        raise UserError(f"--batch_size 1 cannot train --arch {arch} at --img_size {img_size} "
                        f"({reason}): give --batch_size 2 or more, or a larger --img_size")


# A pure function of its flags: its forward runs once per process, however often asked.
@functools.lru_cache(maxsize=None)
def _meta_forward_problem(arch: str, img_size: int, batch: int = 2,
                          train: bool = False) -> Optional[str]:
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = torchvision.models.get_model(arch, num_classes=10, **builder_kwargs(arch))
            model.train(train)(torch.empty(batch, 3, img_size, img_size))
    # Whatever the model raises on an input it cannot take.
    except Exception as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return None


def check_arch_flags(arch: Optional[str], img_size: Optional[int]) -> None:
    """``--arch list`` prints the names and exits; an unknown name, or an image size the
    network cannot take, is one line (None: not given, decided later)."""
    if arch == "list":
        print("\n".join(arch_names()))
        sys.exit(0)
    if arch is not None:
        check_arch(arch)
        if img_size is not None:
            check_input_size(arch, img_size)


def build_model(arch: str, num_classes: int, pretrained: bool = False) -> nn.Module:
    """``arch`` with ``num_classes`` outputs, on the CPU (ImageNet weights with ``pretrained``)."""
    check_arch(arch)
    kwargs = builder_kwargs(arch)
    if not pretrained:
        return torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
    # Downloaded through torch.hub, into its cache: where the error below says to put them.
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        model = torchvision.models.get_model(arch, weights=weights, **kwargs)
    # No network (a URLError is an OSError), or a broken or partial file.
    except (OSError, RuntimeError) as e:
        where = Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[-1]
        raise UserError(f"--pretrained: cannot get torchvision's {arch} weights "
                        f"({(str(e).splitlines() or [type(e).__name__])[0][:120]}). Without a "
                        f"network, put {weights.url} at {where} (TORCH_HOME moves it), or start "
                        "from a checkpoint of your own with --init_from PATH") from None
    if num_classes != len(weights.meta["categories"]):
        _replace_head(model, num_classes)
    return model


def _replace_head(model: nn.Module, num_classes: int) -> None:
    """A new, freshly initialised last layer with ``num_classes`` outputs."""
    heads = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) or (isinstance(m, nn.Conv2d) and m.out_channels == 1000)]
    if not heads:
        raise UserError("--pretrained: found no last layer to resize for this data set")
    name, old = heads[-1]
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    new = (nn.Linear(old.in_features, num_classes) if isinstance(old, nn.Linear)
           else nn.Conv2d(old.in_channels, num_classes, old.kernel_size, old.stride))
    setattr(parent, name.rpartition(".")[2], new)


def autocast_forward(forward: Callable) -> Callable:
    """A module's ``forward`` that runs under ``torch.autocast(input.device.type,
    self.amp_dtype)`` in whatever thread calls it (``amp_dtype`` None: as called): the
    article's ``@autocast()`` on AlexNet's forward, with the dtype chosen at run time.
    DataParallel runs each replica in a thread of its own, where autocast's dtype is not
    the caller's."""

    @functools.wraps(forward)
    def wrapper(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any):
        dtype = getattr(self, "amp_dtype", None)
        if dtype is None:
            return forward(self, x, *args, **kwargs)
        with torch.amp.autocast(device_type=x.device.type, dtype=dtype):
            return forward(self, x, *args, **kwargs)

    return wrapper


class AutocastForward(nn.Module):
    """``module`` whose forward runs under ``torch.autocast(input.device.type, dtype)``, in
    whatever thread calls it (the article's ``@autocast()`` on AlexNet's forward, for any
    module). Its state dict keys carry a ``module.`` prefix, which checkpoints strip like
    DataParallel's."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        # A plain attribute, which DataParallel's replicas copy: autocast_forward reads it
        # in each replica's thread.
        self.amp_dtype = dtype

    @autocast_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def autocast_replicas(module: nn.Module, dtype: torch.dtype) -> AutocastForward:
    """What ``nn.DataParallel`` is about to replicate -- a whole model, or a block such as
    ``model.features`` -- made to compute in ``dtype`` in every replica thread.

    Why: DataParallel runs each replica in a thread of its own, and autocast's state is
    per thread. The threads re-enter autocast with the caller's on/off flag but their own
    default dtype (float16 on CUDA), so a bfloat16 run would silently compute in float16
    there. Wrap what is replicated, whatever it is, and every replica re-enters autocast
    with the run's dtype itself."""
    return AutocastForward(module, dtype)


def check_dp_scope(arch: str, dp_scope: str) -> None:
    """``--dp_scope features`` needs a ``features`` block to replicate: one line if not."""
    if dp_scope != "features":
        return
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        network = torchvision.models.get_model(arch, num_classes=10, **builder_kwargs(arch))
    if not isinstance(getattr(network, "features", None), nn.Module):
        raise UserError(f"--dp_scope features: --arch {arch} has no .features block "
                        "(alexnet, vgg, densenet, mobilenet, efficientnet ... have one)")


def check_param_dtype_fits(network: nn.Module) -> None:
    """FSDP2's MixedPrecisionPolicy casts every parameter to param_dtype, but not buffers:
    a BatchNorm layer would hold bf16/fp16 weights beside float32 running statistics,
    which its kernels refuse. Such a network is one line (autocast handles it)."""
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    if any(isinstance(m, norms) for m in network.modules()):
        raise UserError(f"this --arch ({type(network).__name__}) has BatchNorm layers, whose "
                        "float32 running statistics cannot run beside parameters cast to "
                        "--amp_dtype: use train_FSDP_autocast.py for it")


def shard_units(model: nn.Module) -> List[nn.Module]:
    """The blocks FSDP2 shards one by one, before the root: the model's children that hold
    parameters, and inside an ``nn.Sequential`` child its own such children -- AlexNet's
    conv and linear layers, a ResNet's stem and residual blocks, a ViT's embedding,
    encoder and head. Each block's parameters are gathered just before it runs and freed
    after, so a process holds one whole block at a time, besides its own shards."""
    def has_params(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    units = []
    for child in model.children():
        inner = [c for c in child.children() if has_params(c)]
        if isinstance(child, nn.Sequential) and len(inner) > 1:
            units += inner
        elif has_params(child):
            units.append(child)
    return units


def make_network(arch: str, data, info: DistInfo, *, seed: int, pretrained: bool = False,
                 channels_last: bool = False) -> nn.Module:
    """``arch`` for ``data`` (``ampkit.data.Loaders``: its classes), built from ``seed`` alone
    (the same initial weights on every rank, for any world size), then this rank's own random
    streams seeded; on the process's device, in the channels_last memory format with
    ``channels_last``. A training set whose last batch holds one image a process is one line
    where the network cannot train on one (BatchNorm over a 1 x 1 map)."""
    if data.train_size and data.last_batch(info.world_size) == 1:
        reason = _meta_forward_problem(arch, data.image_shape[-1], batch=1, train=True)
        if reason is not None:
            raise UserError(f"the training set's last batch holds 1 image a process "
                            f"({data.train_size} images, --batch_size {data.batch_size}, "
                            f"{info.world_size} process(es)), which --arch {arch} cannot train "
                            f"on ({reason}): give another --batch_size, or --train_subset")
    torch.manual_seed(seed)
    network = build_model(arch, data.num_classes, pretrained=pretrained)
    seed_streams(seed, info.rank, info.device.type == "cuda")
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return network.to(info.device, memory_format=memory_format)


def compile_in_place(model: torch.nn.Module, mode: str = "default") -> None:
    """``model.compile(mode=mode)`` (in place: the script's step calls the compiled model),
    with the compiled backward outside autocast, where this project's loops run the
    backward. By default a compiled backward runs under the forward's autocast state, which
    torch's AMP notes warn against for code that, like ours, calls backward() outside
    autocast. ``reduce-overhead``: the compiled graphs are also captured and replayed as
    CUDA graphs (one launch for a graph's kernels): CUDA's alone."""
    # A private module, but the only place torch keeps this setting.
    from torch._functorch import config as functorch_config

    if isinstance(model, torch.nn.DataParallel):
        raise UserError("--compile is supported for single-device, DDP and FSDP2 runs, not "
                        "DataParallel")
    device = next(model.parameters()).device
    if mode == "reduce-overhead" and device.type != "cuda":
        raise UserError(f"--compile reduce-overhead replays CUDA graphs: CUDA's alone, not the "
                        f"{device.type}'s; --compile compiles without them")
    # Not in every torch release.
    if hasattr(functorch_config, "backward_pass_autocast"):
        functorch_config.backward_pass_autocast = "off"
    model.compile(mode=mode)


def arch_flops_per_image(arch: str, num_classes: int, image_shape: Tuple[int, ...]) -> float:
    """The FLOPs of a training image of ``arch`` with ``num_classes`` outputs
    (:func:`training_flops_per_image`), built on the meta device from its name: the run's own
    network may be sharded or wrapped by then."""
    with torch.device("meta"), warnings.catch_warnings():
        # The initialisers warn about meta tensors, which are meant here.
        warnings.simplefilter("ignore")
        network = build_model(arch, num_classes)
    return training_flops_per_image(network, image_shape)


def training_flops_per_image(model: nn.Module, image_shape: Tuple[int, ...],
                             batch: int = 2) -> float:
    """FLOPs of one training image: a forward and backward of ``batch`` images through the
    bare ``model`` (in eval mode), divided by ``batch``, counted on the meta device: the
    model's parameters and buffers are stood in for by meta tensors of their shapes
    (``torch.func.functional_call``), so nothing is computed, and no weight, gradient,
    running statistic or random stream of the model moves. (Counted by running the real
    model on the CPU, attention's fused kernel goes uncounted: ViT-B/16 at 224 px then
    shows 4 % fewer FLOPs.)"""
    was_training = model.training
    model.eval()
    try:
        state = {name: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
                 for name, p in model.named_parameters()}
        state |= {name: torch.empty_like(b, device="meta") for name, b in model.named_buffers()}
        images = torch.empty((batch, *image_shape), device="meta")
        counter = FlopCounterMode(display=False)
        with counter:
            functional_call(model, state, (images,)).float().sum().backward()
    finally:
        model.train(was_training)
    return counter.get_total_flops() / batch
