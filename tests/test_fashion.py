"""Fashion-MNIST (ampkit.data.datasets), on small idx files written here: read as
torchvision reads them, from either layout, the same pixels on both input paths, normalised
by its own statistics; every malformed file one line naming it; --train_subset's balanced
subset; the train and eval scripts on it, the eval count exact at any world size."""
from __future__ import annotations

import gzip
import urllib.error

import pytest
import torch
import torchvision

from conftest import parse_accuracy, quick_flags, run_main, run_script
from helpers.fashion_files import NAMES, fashion_arrays, idx_bytes, write_fashion_mnist

from ampkit.data import build_loaders
from ampkit.data import datasets
from ampkit.data.datasets import build_datasets, load_fashion_mnist
from ampkit.data.order import balanced_subset
from ampkit.data.on_device import fast_loaders
from ampkit.distributed import DistInfo
from ampkit.errors import UserError

CPU = DistInfo(device=torch.device("cpu"))
N_TRAIN, N_TEST = 40, 23  # an odd test set: no world size > 1 divides it


@pytest.fixture(scope="module")
def fashion_root(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), N_TRAIN, N_TEST)


def test_reads_what_torchvision_reads_in_either_layout(tmp_path, fashion_root):
    tv_root = write_fashion_mnist(tmp_path, N_TRAIN, N_TEST, layout="torchvision")
    for train in (True, False):
        theirs = torchvision.datasets.FashionMNIST(str(tv_root), train=train)
        for root in (tv_root, fashion_root):
            images, labels = load_fashion_mnist(root, train, download=False)
            assert torch.equal(images, theirs.data) and torch.equal(labels, theirs.targets)


def test_both_paths_give_the_same_pixels_normalised_by_its_own_statistics(fashion_root):
    classic = build_datasets("FashionMNIST", fashion_root, 64, download=False, train=False).val
    _, val, num_classes = fast_loaders("FashionMNIST", fashion_root, 64, 8, CPU, train=False)
    fast_images, fast_labels = next(iter(val))
    pairs = [classic[i] for i in range(8)]
    classic_images = torch.stack([x for x, _ in pairs])
    assert num_classes == 10 and val.dataset_size == N_TEST
    assert fast_images.shape == (8, 3, 64, 64)
    assert torch.equal(fast_labels, torch.tensor([y for _, y in pairs]))
    one_step = 1 / (255 * datasets.FASHION_STD[0])
    assert (fast_images - classic_images).abs().max() <= 1.01 * one_step
    # Three equal channels, and the pixels' own normalisation (ImageNet's would not be equal).
    assert torch.equal(classic_images[:, 0], classic_images[:, 2])
    raw = load_fashion_mnist(fashion_root, False, download=False)[0][:8].float() / 255
    expected = ((raw - datasets.FASHION_MEAN[0]) / datasets.FASHION_STD[0]).mean()
    assert abs(classic_images.mean() - expected) < 0.01 and abs(fast_images.mean() - expected) < 0.01


def _rewrite(root, name, data):
    (root / f"{name}.gz").write_bytes(gzip.compress(data, mtime=0))


def _bad(tmp_path, name, data=None, raw=None):
    root = write_fashion_mnist(tmp_path / "bad", N_TRAIN, N_TEST)
    if raw is not None:
        (root / f"{name}.gz").write_bytes(raw)
    else:
        _rewrite(root, name, data)
    return root


images, labels = fashion_arrays(N_TRAIN, 0)
BAD = {
    "truncated": (NAMES["train"][0], idx_bytes(images)[:-100], "truncated"),
    "too long": (NAMES["train"][0], idx_bytes(images) + b"\0", "too long"),
    "labels as images": (NAMES["train"][0], idx_bytes(labels), "magic number 0x00000801"),
    "counts disagree": (NAMES["train"][1], idx_bytes(labels[:-1]), "40 images but"),
    "label out of range": (NAMES["train"][1], idx_bytes(labels + 10), "not a class index"),
    # A file of 0 items is its header alone: not a tensor read past its end.
    "only the labels empty": (NAMES["train"][1], idx_bytes(labels[:0]), "40 images but .* 0 labels"),
    "sizes past 64 bits": (NAMES["train"][0], idx_bytes(images)[:4] + b"\xff" * 12,
                           "needs 79,228,162,458,924,105,385,300,197,391"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_file_is_one_line_naming_it(tmp_path, case):
    name, data, words = BAD[case]
    root = _bad(tmp_path, name, data)
    with pytest.raises(UserError, match=words) as e:
        load_fashion_mnist(root, True, download=False)
    assert str(root) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("shape, words", [((0, 28, 28), "holds no images"),
                                           ((40, 0, 28), "holds images of 0 x 28")])
def test_an_empty_split_is_one_line(tmp_path, shape, words):
    """Both files of a split describe no pixels: one line, whichever split a script reads."""
    root = _bad(tmp_path, NAMES["test"][0], idx_bytes(images[:shape[0], :shape[1]]))
    count = shape[0]
    _rewrite(root, NAMES["test"][1], idx_bytes(labels[:count]))
    for run in (lambda: load_fashion_mnist(root, False, download=False),
                lambda: build_loaders("FashionMNIST", root, 32, 8, CPU, loader="classic")):
        with pytest.raises(UserError, match=words) as e:
            run()
        assert NAMES["test"][0] in str(e.value) and "\n" not in str(e.value)


def test_both_paths_read_the_idx_files_whatever_cache_lies_beside_them(tmp_path):
    """torchvision's own FashionMNIST loads its legacy cache (``processed/*.pt``) where one
    exists, unchecked: the classic path reads the checked idx files all the same."""
    root = write_fashion_mnist(tmp_path, N_TRAIN, N_TEST, layout="torchvision")
    processed = root / "FashionMNIST" / "processed"
    processed.mkdir()
    for name, n in (("training.pt", N_TRAIN), ("test.pt", N_TEST)):
        torch.save((torch.zeros(n, 28, 28, dtype=torch.uint8), torch.full((n,), 7)),
                   processed / name)
    assert (torchvision.datasets.FashionMNIST(str(root), train=False).targets == 7).all()
    for train in (True, False):
        checked = load_fashion_mnist(root, train, download=False)
        classic = datasets.FashionMNIST(root, train, None, download=False)
        assert torch.equal(classic.data, checked[0]) and torch.equal(classic.targets, checked[1])


def test_not_gzip_and_an_incomplete_folder_are_one_line(tmp_path):
    root = _bad(tmp_path, NAMES["test"][0], raw=b"not gzip at all")
    with pytest.raises(UserError, match=f"{NAMES['test'][0]}.gz: cannot be read as gzip"):
        load_fashion_mnist(root, False, download=False)
    (root / f"{NAMES['test'][1]}.gz").unlink()
    with pytest.raises(UserError, match=f"incomplete: {NAMES['test'][1]} missing"):
        load_fashion_mnist(root, True, download=False)


def test_no_network_is_one_line_naming_the_offline_way(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", no_network)
    with pytest.raises(UserError, match="could not be downloaded .*apt install "
                                        "dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path, True, download=True)


def test_cifar_without_a_network_names_fashion_mnist_as_the_real_data_offline(tmp_path,
                                                                              monkeypatch):
    """The default data set cannot be downloaded: the one line says where real data is
    without a network, not only the generated kinds."""
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(datasets, "download_url", no_network)
    with pytest.raises(UserError, match="could not be downloaded .*--dataset FashionMNIST "
                                        r"\(apt install dataset-fashion-mnist"):
        datasets.cifar10(tmp_path, True, None, download=True)


def test_the_subset_is_balanced_seed_free_and_the_same_on_both_paths(fashion_root):
    labels = load_fashion_mnist(fashion_root, True, download=False)[1]
    chosen = balanced_subset(labels, 25, 10)
    assert torch.bincount(labels[chosen], minlength=10).tolist() == [3] * 5 + [2] * 5
    assert chosen == balanced_subset(labels, 25, 10) == sorted(chosen)
    fast = build_loaders("FashionMNIST", fashion_root, 32, 8, CPU, loader="fast", train_subset=25)
    classic = build_loaders("FashionMNIST", fashion_root, 32, 8, CPU, loader="classic",
                            train_subset=25)
    assert fast.train_size == classic.train_size == 25 and fast.val_size == N_TEST
    assert torch.equal(fast.train_set.tensors[1], labels[chosen])
    assert classic.train_set.indices == chosen
    with pytest.raises(UserError, match="--train_subset 41"):
        balanced_subset(labels, 41, 10)


def test_train_then_eval_counts_the_whole_test_set_and_resume_keeps_the_subset(fashion_root,
                                                                               tmp_path):
    flags = quick_flags(fashion_root, tmp_path, dataset="FashionMNIST", img_size=32,
                        epochs=1, batch_size=8, train_subset=20)
    run = run_main("train_without", *flags)
    assert run.returncode == 0, run.describe()
    assert "FashionMNIST (20 train / 23 val images" in run.stdout, run.stdout
    result = run_main("eval_without", "--checkpoint", tmp_path / "train_without", "--no-cuda")
    assert parse_accuracy(result.stdout)[1] == N_TEST, result.describe()
    other = run_main("train_without", *flags, "--train_subset", "30", "--epochs", "2",
                     "--resume")
    assert other.returncode == 2 and "--train_subset 20 (this run: 30)" in other.stderr, \
        other.describe()
    # A checkpoint from before the flag existed trained on the whole set.
    last = tmp_path / "train_without" / "last.pth"
    older = torch.load(last, weights_only=True)
    del older["args"]["train_subset"]
    torch.save(older, last)
    other = run_main("train_without", *flags, "--epochs", "2", "--resume")
    assert other.returncode == 2 and "--train_subset not given (this run: 20)" in other.stderr, \
        other.describe()


@pytest.mark.slow
def test_eval_ddp_at_three_ranks_counts_each_test_image_once(fashion_root, tmp_path):
    flags = quick_flags(fashion_root, tmp_path, dataset="FashionMNIST", img_size=32,
                        epochs=1, batch_size=8, train_subset=20)
    assert run_main("train_without", *flags).returncode == 0
    one = parse_accuracy(run_main("eval_without", "--checkpoint", tmp_path / "train_without",
                                  "--no-cuda").stdout)
    three = run_script("eval_DDP", "--checkpoint", tmp_path / "train_without", "--no-cuda",
                       torchrun_nproc=3)
    assert parse_accuracy(three.stdout) == one and one[1] == N_TEST, three.describe()
