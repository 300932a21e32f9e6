"""Wrapper prefixes: whatever wraps the model (DP on the whole model or on model.features,
DDP, torch.compile), the saved weights carry the bare AlexNet's keys."""
import torch
from torch import nn

import train_DP
from alexnet import alexnet
from ampkit.checkpoint import files as checkpoint_files


def _bare_keys():
    return set(alexnet(num_classes=3).state_dict())


def _dp(dp_scope: str) -> nn.Module:
    """train_DP's model as on CUDA, where it wraps (without GPUs, the DataParallel built
    calls the model as it is)."""
    model = alexnet(num_classes=3)
    return train_DP.build(model, nn.CrossEntropyLoss(), device=torch.device("cuda"), lr=1e-4,
                          clip_grad=None, dp_scope=dp_scope).model


def _saved(model: nn.Module) -> dict:
    """The weights as a DataParallel script hands them over (the model inside a whole-model
    DataParallel), as the checkpoint holds them."""
    bare = model.module if isinstance(model, nn.DataParallel) else model
    return checkpoint_files.strip_prefixes(bare.state_dict())  # as the saver writes them


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
