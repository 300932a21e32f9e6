"""Wrapper prefixes: whatever wraps the model (DP on the whole model or on model.features,
DDP, torch.compile), the saved weights carry the bare AlexNet's keys."""
from types import SimpleNamespace

import torch
from torch import nn

import train_DP
from alexnet import alexnet
from ampkit.technique import Parts
from ampkit.checkpoint import files as checkpoint_files
from ampkit.device import DistInfo
from ampkit.checkpoint.saver import checkpoint_state


def _bare_keys():
    return set(alexnet(num_classes=3).state_dict())


def _dp(dp_scope: str) -> nn.Module:
    """train_DP's model as on CUDA, where it wraps (without GPUs, the DataParallel built
    calls the model as it is)."""
    model = alexnet(num_classes=3)
    parts = Parts(model, nn.CrossEntropyLoss(), dp_scope=dp_scope, device=torch.device("cuda"))
    return train_DP.build(parts).model


def _saved(model: nn.Module) -> dict:
    """The weights as a DataParallel script hands them over (the model inside a whole-model
    DataParallel), as the checkpoint holds them."""
    bare = model.module if isinstance(model, nn.DataParallel) else model
    args = SimpleNamespace(arch="alexnet", variant="train_DP")
    return checkpoint_state({"model": bare.state_dict()}, args, DistInfo(torch.device("cpu")),
                            {}, 3, random_states=None)["model"]


def test_dp_on_features_only_saves_bare_keys_and_runs():
    model = _dp("features")
    assert isinstance(model.features, nn.DataParallel)
    assert any(".module." in k for k in model.state_dict())  # the raw keys do carry it
    state = _saved(model)
    assert set(state) == _bare_keys()
    fresh = alexnet(num_classes=3)
    fresh.load_state_dict(state)  # strict: every key matches
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 3)


def test_whole_model_dp_saves_bare_keys():
    model = _dp("model")
    assert all(k.startswith("module.") for k in model.state_dict())
    assert set(_saved(model)) == _bare_keys()


def test_strip_prefixes_handles_nested_and_compiled_wrappers():
    state = {"module._orig_mod.features.module.0.weight": 1, "classifier.6.bias": 2}
    expected = {"features.0.weight": 1, "classifier.6.bias": 2}
    assert checkpoint_files.strip_prefixes(state) == expected
