"""Beyond AlexNet and DDP: any torchvision classifier (--arch), and FSDP2 as a fourth
parallel mode (its gradients, its checkpoints, its resume after a SIGKILL)."""
from __future__ import annotations

import json
import re
import signal

import pytest
import torch
from torch import nn

from conftest import (FSDP_ARCH, IF_VAL_SIZE, REPO_ROOT, as_a_dataparallel_replica,
                      parse_accuracy, quick_flags, run_main, run_script, tiny_args)
from helpers.processes import finish, kill_job, start, torchrun, wait_for

CPU = torch.device("cpu")


def _main(script: str, argv: list, capsys=None) -> tuple:
    """conftest.run_main's run, its stderr as lines: (exit status, stdout, stderr lines)."""
    code, out, err = run_main(script, *argv)
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


# ------------------------------------------------------------------ --arch: bad input
@pytest.mark.parametrize("flags,words", [
    (["--arch", "resnet"], "--arch list"),
    (["--arch", "vit_b_16"], "Wrong image height"),  # 64 px: ViT-B/16 takes 224 only
    (["--arch", "resnet18", "--dp_scope", "features"], "has no .features block"),
])
def test_arch_mistakes_are_one_line(flags, words, imagefolder_root, tmp_path, capsys):
    code, out, err = _main("train_DP", tiny_args(tmp_path, imagefolder_root) + flags, capsys)
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not list(tmp_path.rglob("*.pth"))


def test_arch_list_prints_the_names(capsys):
    code, out, err = _main("train_without", ["--arch", "list"], capsys)
    names = out.split()
    assert code == 0 and {"alexnet", "resnet18", "vit_b_16", "efficientnet_b0"} <= set(names)


def test_pretrained_without_a_network_is_one_line_naming_what_to_do(imagefolder_root,
                                                                     tmp_path, monkeypatch):
    """torchvision's weights download through torch.hub: without a network (or with a
    broken file in its cache) the run ends in one line that says where the file goes."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    code, out, err = _main("train_without", quick_flags(imagefolder_root, tmp_path / "ckpt",
                                                        "--pretrained"))
    assert code == 2 and len(err) == 1, err
    assert "--pretrained" in err[0] and str(tmp_path / "torch_home") in err[0] \
        and "--init_from" in err[0], err


def test_pretrained_head_is_resized_for_the_data_set():
    """--pretrained keeps the backbone and gives the last layer the data set's classes (the
    weights themselves are downloaded by torchvision, never in tests)."""
    import torchvision

    from ampkit.models import _replace_head

    for arch, head in (("resnet18", "fc"), ("mobilenet_v3_small", "classifier.3"),
                       ("squeezenet1_1", "classifier.1")):
        model = torchvision.models.get_model(arch)  # 1000 classes, as the weights are
        _replace_head(model, 7)
        layer = model.get_submodule(head)
        assert (layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels) == 7
        model.eval()
        with torch.no_grad():
            assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)


# ------------------------------------------------------------------ --arch: end to end
@pytest.mark.slow
def test_another_arch_under_ddp_autocast_and_exact_eval(imagefolder_root, tmp_path):
    """ShuffleNet V2 under DDP with autocast (a group of one), then eval_DDP rebuilds it from
    the checkpoint."""
    args = tiny_args(tmp_path, imagefolder_root, batch_size=12) + ["--arch", "shufflenet_v2_x0_5"]
    res = run_main("train_DDP_autocast", *args)
    assert res.returncode == 0, res.describe()
    assert "precision autocast (bfloat16)" in res.stdout
    ckpt = tmp_path / "checkpoint" / "train_DDP_autocast" / "last.pth"
    state = torch.load(ckpt, weights_only=True, mmap=True)
    assert state["arch"] == "shufflenet_v2_x0_5" and "fc.weight" in state["model"]
    ev = run_main("eval_DDP", "--checkpoint", ckpt, "--no-cuda")  # rebuilds the ShuffleNet
    assert ev.returncode == 0, ev.describe()
    assert "(shufflenet_v2_x0_5, trained on ImageFolder" in ev.stdout
    # The last epoch's validation counted the same on the same weights.
    *_, correct, total = re.findall(r"val_acc \S+ \((\d+)/(\d+)\)", res.stdout)[-1]
    assert parse_accuracy(ev.stdout) == (int(correct), int(total)) and int(total) == IF_VAL_SIZE


@pytest.mark.slow
def test_mobilenet_under_dp_gradscaler_and_eval(imagefolder_root, tmp_path, capsys):
    args = tiny_args(tmp_path, imagefolder_root, batch_size=48) + ["--arch", "mobilenet_v3_small"]
    code, out, err = _main("train_DP_GradScaler", args, capsys)
    assert code == 0, err
    ckpt = tmp_path / "checkpoint" / "train_DP_GradScaler" / "best.pth"
    keys = torch.load(ckpt, weights_only=True, mmap=True)["model"]
    assert "classifier.3.weight" in keys and not any(k.startswith("module.") for k in keys)
    code, out, err = _main("eval_DP", ["--checkpoint", ckpt, "--no-cuda", "--autocast"], capsys)
    assert code == 0 and "(mobilenet_v3_small, trained on" in out and "autocast bfloat16" in out
    assert parse_accuracy(out)[1] == IF_VAL_SIZE
    code, out, err = _main("eval_without", ["--checkpoint", ckpt, "--no-cuda", "--arch",
                                            "resnet18"], capsys)
    assert code == 2 and "holds a mobilenet_v3_small" in err[0], err


def test_bf16_under_dataparallel_for_any_arch():
    """DataParallel's replica threads re-enter autocast with the default dtype, not the run's.
    A non-AlexNet model, as train_DP_autocast's build() hands it to DataParallel, must still
    compute in the run's dtype there: float16 on the CPU, where the default is bfloat16,
    shows the difference."""
    import torchvision

    from ampkit.models import autocast_replicas

    torch.manual_seed(0)
    net = torchvision.models.get_model("resnet18", num_classes=3).eval()
    replica = autocast_replicas(net, torch.float16)  # what DataParallel runs in each thread
    seen = {}
    net.layer1[0].conv1.register_forward_hook(lambda m, i, o: seen.__setitem__("conv", o.dtype))
    default, _ = as_a_dataparallel_replica(replica, torch.randn(2, 3, 64, 64), torch.float16)
    assert default == torch.bfloat16  # control: the thread's own default dtype
    assert seen["conv"] == torch.float16


# ------------------------------------------------------------------ FSDP2
@pytest.mark.slow
def test_fsdp_resumes_after_sigkill(imagefolder_root, tmp_path):
    flags = tiny_args(tmp_path, imagefolder_root, epochs=2, batch_size=8) + ["--arch", FSDP_ARCH]
    run_dir = tmp_path / "checkpoint" / "train_FSDP_GradScaler"
    proc = start(torchrun("--standalone", "--nproc_per_node=2",
                          REPO_ROOT / "AMP" / "train_FSDP_GradScaler.py", *flags))
    wait_for((run_dir / "last.pth").exists, 180, proc)  # epoch 1 saved: kill in epoch 2 or so
    kill_job(proc.pid, signal.SIGKILL)  # every process of the job, mid-save or mid-epoch
    finish(proc, 60)
    done = torch.load(run_dir / "last.pth", weights_only=True, mmap=True)["progress"]["epoch"]
    assert 1 <= done <= 2
    res = run_script("train_FSDP_GradScaler", *flags, "--resume", torchrun_nproc=2)
    assert res.returncode == 0, res.describe()
    if done < 2:
        assert f"resumed from {run_dir / 'last.pth'}: epoch {done + 1}" in res.stdout
    final = torch.load(run_dir / "last.pth", weights_only=True, mmap=True)
    assert final["progress"]["epoch"] == 2 and final["scaler"]["scale"] > 0
    assert "features.0.0.weight" in final["optimizer"]["state"]  # the full, gathered state
    rows = [json.loads(line)["epoch"] for line in (run_dir / "log.jsonl").read_text().splitlines()]
    assert rows == [1, 2]


@pytest.mark.parametrize("variant", ["train_FSDP_autocast", "train_FSDP_mixed"])
def test_fsdp_precision_is_what_the_script_says(variant, gloo_of_one):
    """autocast: per operator, under the script's autocast; MixedPrecisionPolicy: the block's
    parameters are cast, no autocast needed, and the root's output is float32 again."""
    from alexnet import alexnet
    from tools.variants import build_variant

    torch.manual_seed(0)
    net = alexnet(num_classes=3).eval()
    seen = {}
    net.classifier[4].register_forward_hook(lambda m, i, o: seen.__setitem__("fc2", o.dtype))
    v = build_variant(variant, net, amp_dtype=torch.bfloat16)
    assert (v.autocast is not None) == variant.endswith("autocast")
    with torch.no_grad(), v.autocast or torch.autocast("cpu", enabled=False):
        out = v.model(torch.randn(2, 3, 64, 64))
    assert seen["fc2"] == torch.bfloat16
    assert out.dtype == (torch.float32 if variant.endswith("mixed") else torch.bfloat16)
    assert type(net.features[0].weight).__name__ == "DTensor"  # sharded
    assert next(iter(v.model.parameters())).dtype == torch.float32  # the shards stay fp32


def test_fsdp_mixed_scales_the_loss_for_a_float16_reduce(gloo_of_one):
    """--amp_dtype bfloat16 --reduce_dtype float16: the gradients are reduced (and added up)
    in float16, where values under 6e-8 flush to zero; a GradScaler scales them first, so a
    tiny loss still gives the optimizer its gradients (and its skips are counted)."""
    from tools.variants import build_variant

    class TinyLoss(nn.CrossEntropyLoss):
        def forward(self, outputs, targets):
            return super().forward(outputs, targets) * 1e-9

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
    t = build_variant("train_FSDP_mixed", net, TinyLoss(), amp_dtype=torch.bfloat16,
                      reduce_dtype=torch.float16, lr=0.0)
    assert t.scaler is not None and t.autocast is None
    _, norm = t.train_step([(torch.randn(4, 3, 2, 2), torch.tensor([0, 1, 2, 0]))])
    assert 1e-11 < norm.item() < 1e-8  # unscaled, and not flushed to zero on the wire


def test_fsdp_mixed_refuses_batchnorm_networks():
    import torchvision

    from ampkit.errors import UserError
    from tools.variants import build_variant

    net = torchvision.models.get_model("resnet18", num_classes=3)
    with pytest.raises(UserError, match="BatchNorm.*train_FSDP_autocast"):
        build_variant("train_FSDP_mixed", net)


def test_fsdp_takes_a_channels_last_model(gloo_of_one):
    """--channels_last makes the conv weights channels_last, which fully_shard refuses
    ("FSDP does not support non-contiguous parameters"): the FSDP2 scripts shard contiguous
    weights and still train on channels_last inputs."""
    from alexnet import alexnet
    from tools.variants import build_variant

    torch.manual_seed(0)
    net = alexnet(num_classes=3).to(memory_format=torch.channels_last)
    t = build_variant("train_FSDP", net)
    images = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    [loss], norm = t.train_step([(images, torch.tensor([0, 2]))])
    assert torch.isfinite(loss) and torch.isfinite(norm)
    assert type(net.features[0].weight).__name__ == "DTensor"
