"""The fast input path (ampkit.data.on_device) against the classic DataLoader path (ampkit.data.classic).

- Same samples: for the same indices, the same labels and, within one uint8 step of
  interpolation rounding, the same images as torchvision's PIL transforms; the same
  training order as the classic path's DistributedSampler.
- DDP sharding (two ranks simulated in one process): every training sample once per
  epoch (padded like DistributedSampler when N is odd), a new order every epoch,
  ``start_index`` skipping exactly the first batches; validation shards cover each
  sample once.
- Learning: a short training on a tiny learnable CIFAR-format set reaches the same
  accuracy through either path.
"""
from __future__ import annotations

import math
import signal

import pytest
import torch
import torchvision.transforms.functional as TF

from torch.utils.data import DistributedSampler

from ampkit.distributed import DistInfo
from ampkit.errors import UserError
from ampkit.data.classic import eval_dataloader, train_dataloader
from ampkit.data.datasets import STD, build_datasets, build_transform
from ampkit.data.order import one_process_sampler
from ampkit.data import build_loaders
from ampkit.data.on_device import DeviceLoader, fast_loaders, load_uint8
from tools.cifar_files import write_cifar10
from tools.measure_input import _ctrl_c_between_batches, measure_input_pipeline

CPU = torch.device("cpu")
# One uint8 step after normalisation (the largest for the smallest std): PIL rounds its
# bilinear result to uint8, the float resize (the CUDA path) does not.
UINT8_STEP = 1 / (255 * min(STD))


def info(rank: int = 0, world_size: int = 1) -> DistInfo:
    return DistInfo(device=CPU, rank=rank, world_size=world_size)


def classic_images(dataset, indices, img_size):
    tf = build_transform(img_size)
    dataset.transform = tf
    pairs = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in pairs]), torch.tensor([y for _, y in pairs])


# --------------------------------------------------------------------------- same samples
@pytest.mark.parametrize("name", ["CIFAR10", "FakeData"])
@pytest.mark.parametrize("img_size,resize_uint8", [(227, True), (227, False), (64, True),
                                                   (64, False), (32, True)])
def test_same_images_and_labels_as_classic(name, img_size, resize_uint8, cifar_root):
    """Validation order is rank::world_size in both paths, so batches line up index by index.
    resize_uint8=False runs the float resize that CUDA uses, here on the CPU."""
    classic = build_datasets(name, cifar_root, img_size, download=False, train=False).val
    _, val, num_classes = fast_loaders(name, cifar_root, img_size, 8, info(), train=False)
    val.resize_uint8 = resize_uint8
    images, labels = next(iter(val))
    ref_images, ref_labels = classic_images(classic, range(8), img_size)

    assert num_classes == 10 and val.dataset_size == len(classic)
    assert images.dtype == torch.float32 and images.shape == (8, 3, img_size, img_size)
    assert images.is_contiguous() and labels.dtype == torch.int64
    assert torch.equal(labels, ref_labels)
    diff = (images - ref_images).abs()
    # Measured (torch 2.14, Pillow 11): max = one uint8 step (0.0175) on both resize paths;
    # mean 2e-5 (uint8 resize, rounds like PIL) and 0.006 (float resize, unrounded).
    assert diff.max() <= 1.01 * UINT8_STEP, diff.max()
    assert diff.mean() <= (0.001 if resize_uint8 else 0.01), diff.mean()


def test_uint8_split_matches_torchvision(cifar_root):
    classic = build_datasets("CIFAR10", cifar_root, 32, download=False)
    for split, ds in (("train", classic.train), ("val", classic.val)):
        images, labels = load_uint8("CIFAR10", cifar_root, info(), train=split == "train")
        assert images.dtype == torch.uint8 and images.is_contiguous()
        assert images.shape == (len(ds), 3, 32, 32)
        assert torch.equal(images, torch.from_numpy(ds.data).permute(0, 3, 1, 2))
        assert labels.tolist() == ds.targets


def test_training_order_and_flips_match_classic(cifar_root):
    """Same permutation and the same flips, drawn from (seed, epoch, rank) by the sampler on
    both paths: each epoch's images are the classic path's to one uint8 step, some of them
    mirrored; and a resumed epoch (``batches(start)``) gets the very flips of its rest."""
    img_size = 64
    classic = build_datasets("CIFAR10", cifar_root, img_size, download=False)
    train_set, _, _ = fast_loaders("CIFAR10", cifar_root, img_size, 8, info())
    fast_order, classic_order = (one_process_sampler(len(train_set), 3) for _ in range(2))
    train = train_set.loader(fast_order)
    classic_dl = train_dataloader(classic.train, classic_order, batch_size=8, img_size=img_size)
    for epoch in (0, 1):
        fast_order.set_epoch(epoch)
        classic_order.set_epoch(epoch)
        order, flips = zip(*classic_dl.sampler)
        assert list(train.sampler) == list(order) and 0 < sum(flips) < len(order)
        images, labels = map(torch.cat, zip(*train))
        ref_images, ref_labels = map(torch.cat, zip(*classic_dl))
        assert torch.equal(labels, ref_labels)
        assert (images - ref_images).abs().max() <= 1.01 * UINT8_STEP
        plain, _ = classic_images(classic.train, order, img_size)
        mirrored = torch.tensor(flips).view(-1, 1, 1, 1)
        assert torch.equal(ref_images, torch.where(mirrored, TF.hflip(plain), plain))
        # A resumed epoch from its second batch on: the same images, the same flips.
        assert torch.equal(torch.cat([x for x, _ in classic_dl.batches(1)]), ref_images[8:])
        assert torch.equal(torch.cat([x for x, _ in train.batches(1)]), images[8:])


def test_channels_last_option(cifar_root):
    _, val, _ = fast_loaders("CIFAR10", cifar_root, 64, 4, info(), channels_last=True)
    _, ref, _ = fast_loaders("CIFAR10", cifar_root, 64, 4, info())
    for resize_uint8 in (True, False):
        val.resize_uint8 = ref.resize_uint8 = resize_uint8
        x, x_ref = next(iter(val))[0], next(iter(ref))[0]
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(x, x_ref)


def test_in_memory_datasets_only(imagefolder_root, cifar_root, tmp_path, monkeypatch):
    auto = {name: build_loaders(name, root, 32, 8, info()).kind
            for name, root in (("CIFAR10", cifar_root), ("FakeData", cifar_root),
                               ("ImageFolder", imagefolder_root))}
    assert auto == {"CIFAR10": "fast", "FakeData": "fast", "ImageFolder": "classic"}
    with pytest.raises(UserError, match="classic"):
        fast_loaders("ImageFolder", imagefolder_root, 64, 8, info())
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network disabled in tests")
    # No network in tests: the download attempt fails at once, whatever the machine.
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(UserError, match="CIFAR-10 is not in"):  # the classic path's message
        load_uint8("CIFAR10", tmp_path / "empty", info(), train=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        load_uint8("CIFAR10", tmp_path / "file", info(), train=True)
    with pytest.raises(UserError, match="unknown --dataset"):
        load_uint8("MNIST", tmp_path, info(), train=True)


# --------------------------------------------------------------------------- DDP sharding
def identity_loaders(n, world_size, *, batch_size=4, train=True, seed=0):
    """One loader per simulated rank whose labels are the sample indices; training in the
    order of that rank's DistributedSampler, as a DDP script makes it."""
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 2, 2).contiguous()
    labels = torch.arange(n)
    return [DeviceLoader(images, labels, batch_size=batch_size, img_size=2, device=CPU,
                         train=train, info=info(r, world_size),
                         sampler=DistributedSampler(range(n), num_replicas=world_size, rank=r,
                                                    shuffle=True, seed=seed) if train else None)
            for r in range(world_size)]


def set_epoch(loaders, epoch):
    for loader in loaders:
        loader.sampler.sampler.set_epoch(epoch)  # the DistributedSampler in the resumable one


def seen(loader):
    return [i for _, targets in loader for i in targets.tolist()]


@pytest.mark.parametrize("n", [30, 31])
def test_two_ranks_see_every_sample_once_per_epoch(n):
    ranks = identity_loaders(n, 2)
    orders = []
    for epoch in (0, 1, 2):
        set_epoch(ranks, epoch)
        shares = [seen(r) for r in ranks]
        assert [len(s) for s in shares] == [math.ceil(n / 2)] * 2
        assert [len(r) for r in ranks] == [math.ceil(math.ceil(n / 2) / 4)] * 2
        union = sorted(shares[0] + shares[1])
        if n % 2 == 0:
            assert union == list(range(n))
        else:  # DistributedSampler pads with the start of the permutation: one repeat
            assert sorted(set(union)) == list(range(n)) and len(union) == n + 1
        orders.append(shares)
    assert orders[0] != orders[1] != orders[2]
    # The same seed and epoch give the same order (what a resumed run relies on).
    again = identity_loaders(n, 2)
    set_epoch(again, 1)
    assert [seen(r) for r in again] == orders[1]


def test_a_resumed_epoch_skips_exactly_its_first_batches():
    loader = identity_loaders(50, 2, batch_size=4)[1]
    set_epoch([loader], 5)
    full = list(loader)
    assert len(loader) == len(full) == 7
    resumed = list(loader.batches(3))
    assert len(loader) == 7 and len(resumed) == 4 and len(list(loader)) == 7
    for (x, y), (x_ref, y_ref) in zip(resumed, full[3:]):
        assert torch.equal(y, y_ref) and torch.equal(x, x_ref)  # same samples, same flips


def test_flips_reproducible_per_seed_epoch_rank(cifar_root):
    images, labels = load_uint8("CIFAR10", cifar_root, info(), train=True)

    def flips(seed, epoch, rank):
        order = DistributedSampler(range(len(labels)), num_replicas=2, rank=rank, seed=seed)
        loader = DeviceLoader(images, labels, batch_size=32, img_size=32, device=CPU,
                              train=True, info=info(rank, 2), sampler=order)
        order.set_epoch(epoch)
        return loader._epoch_indices()[1]

    assert torch.equal(flips(0, 0, 0), flips(0, 0, 0))
    assert not torch.equal(flips(0, 0, 0), flips(0, 1, 0))
    assert not torch.equal(flips(0, 0, 0), flips(1, 0, 0))
    assert not torch.equal(flips(0, 0, 0), flips(0, 0, 1))


@pytest.mark.parametrize("n", [11, 12])
def test_validation_shards_cover_each_sample_once(n):
    ranks = identity_loaders(n, 2, train=False)
    shares = [seen(r) for r in ranks]
    assert sorted(shares[0] + shares[1]) == list(range(n))
    assert shares[0] == list(range(0, n, 2)) and shares[1] == list(range(1, n, 2))
    assert [len(r) for r in ranks] == [math.ceil(len(s) / 4) for s in shares]
    assert all(r.dataset_size == n for r in ranks)


# --------------------------------------------------------------------------- learning
def train_and_evaluate(train_dl, val_dl, num_classes, epochs=4):
    from alexnet import alexnet
    from ampkit.engine import count_correct, train_one_epoch
    from helpers.meters import meters_of
    from tools.variants import build_variant

    torch.manual_seed(0)  # same initial weights, dropout and (classic) flip streams
    model = alexnet(num_classes=num_classes)
    # The two 4096-wide linear layers stay at their random initialisation: their weights
    # are 95% of AlexNet's and would make each step ~5x slower on the CPU. What is
    # compared here is the input path, not the model.
    for i in (1, 4):
        model.classifier[i].requires_grad_(False)
    v = build_variant("train_without", model, lr=3e-4)
    losses = []
    for epoch in range(epochs):
        train_dl.sampler.sampler.set_epoch(epoch)
        model.train()
        losses.append(train_one_epoch(v.train_step, train_dl, info(),
                                      meters=meters_of(v)).loss)
    correct, total = count_correct(model, val_dl, info()).tolist()
    return correct / total, losses


@pytest.mark.slow  # 4 epochs on each path: a learning test, not one of the quick checks
def test_fast_path_learns_as_well_as_classic(tmp_path):
    root = write_cifar10(tmp_path, 128, 48, learnable=True, num_classes=4)
    img_size, batch = 64, 16
    train_set, val_dl, num_classes = fast_loaders("CIFAR10", root, img_size, batch, info())
    fast_acc, fast_losses = train_and_evaluate(train_set.loader(), val_dl, num_classes)
    data = build_datasets("CIFAR10", root, img_size, download=False)
    classic_acc, classic_losses = train_and_evaluate(
        train_dataloader(data.train, batch_size=batch, img_size=img_size, seed=0),
        eval_dataloader(data.val, info(), batch_size=batch, img_size=img_size), data.num_classes)
    # 4 classes (chance 0.25). Measured: 1.0 on both paths, losses 1.94 -> 0.7.
    assert fast_acc >= 0.7 and classic_acc >= 0.7, (fast_acc, classic_acc)
    assert fast_acc >= classic_acc - 0.25, (fast_acc, classic_acc)
    assert fast_losses[-1] < 0.8 * fast_losses[0], fast_losses


# --------------------------------------------------------------------------- benchmark
def test_measure_input_pipeline_runs(tmp_path):
    root = write_cifar10(tmp_path, 96, 16)
    for kind in ("article", "classic", "fast"):
        rate = measure_input_pipeline(kind, root=root, img_size=64, batch_size=16,
                                      warmup=1, max_batches=2, device=CPU)
        assert rate > 0
    with pytest.raises(ValueError):
        measure_input_pipeline("nope")


def test_benchmark_cli_input_paths_only(capsys, tmp_path):
    """`benchmark.py --variants none --pipeline all`: the three input paths, no model."""
    import benchmark

    code = benchmark.main(["--variants", "none", "--pipeline", "all", "--no-cuda", "--img_size",
                           "64", "--batch_size", "16", "--pipeline_batches", "1", "--warmup", "1",
                           "--repeat", "2", "--dataset_root", str(tmp_path / "none")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Training step" not in out and "best of 2" in out, out
    rates = {ln.split()[0]: float(ln.split()[-1]) for ln in out.splitlines()
             if ln.split() and ln.split()[0] in ("article", "classic", "fast")}
    assert sorted(rates) == ["article", "classic", "fast"] and min(rates.values()) > 0, out


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_batches_on_the_gpu_without_host_syncs(cifar_root):
    device = torch.device("cuda")
    cuda_info = DistInfo(device=device)
    train_set, val, _ = fast_loaders("CIFAR10", cifar_root, 227, 8, cuda_info)
    order = one_process_sampler(len(train_set), 1)
    train = train_set.loader(order)
    _, val_cpu, _ = fast_loaders("CIFAR10", cifar_root, 227, 8, info())
    assert train.images.device.type == "cuda" and not train.resize_uint8
    x, y = next(iter(val))
    x_cpu, y_cpu = next(iter(val_cpu))
    assert x.device.type == "cuda" and y.device.type == "cuda"
    assert torch.equal(y.cpu(), y_cpu)
    assert (x.cpu() - x_cpu).abs().max() <= 1.5 * UINT8_STEP  # float resize on the GPU
    order.set_epoch(1)
    batches = iter(train)
    sizes = [next(batches)[0].shape[0]]  # the epoch's set-up: permutation, flips
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync in the per-step path raises
    try:
        sizes += [x.shape[0] for x, _ in batches]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(sizes) == train.sampler.num_samples and len(sizes) == len(train) > 2


@pytest.mark.slow  # scikit-learn's import alone is most of it: a tool's test, not a quick check
def test_the_digits_are_a_stratified_seeded_imagefolder(tmp_path):
    """scikit-learn's 1,797 digits as train/ and val/ class folders: a fifth of each digit
    in val/, the same files each time, RGB images the classic path reads."""
    pytest.importorskip("sklearn")
    from PIL import Image

    from tools.digits import write_digits

    root = write_digits(tmp_path / "a")
    train = {d.name: len(list(d.iterdir())) for d in (root / "train").iterdir()}
    val = {d.name: len(list(d.iterdir())) for d in (root / "val").iterdir()}
    assert sorted(train) == sorted(val) == [str(i) for i in range(10)]
    assert sum(train.values()) + sum(val.values()) == 1797 and sum(val.values()) == 359
    assert all(abs(val[k] / (val[k] + train[k]) - 0.2) < 0.01 for k in val)
    again = write_digits(tmp_path / "b")
    assert sorted(p.relative_to(again) for p in again.rglob("*.png")) == \
        sorted(p.relative_to(root) for p in root.rglob("*.png"))
    image = Image.open(next((root / "val" / "3").iterdir()))
    assert image.mode == "RGB" and image.size == (8, 8)


def test_a_ctrl_c_the_benchmark_held_after_its_last_batch_still_ends_it():
    """The input benchmark holds Ctrl-C until the batch in flight has arrived. One that
    lands after the last batch's check (while the loader's workers shut down) is raised as
    the measurement ends: it is not lost, and the run does not go on."""
    held = False
    with pytest.raises(KeyboardInterrupt):
        with _ctrl_c_between_batches() as check:
            check()  # after the last batch
            signal.raise_signal(signal.SIGINT)
            held = True  # not raised here
    assert held
