"""Run the HF reference models on the device the tests' engine uses (GPT_INSPECTOR_TEST_DEVICE).

The suite runs on the CPU here and in CI. On a machine with a GPU, ``GPT_INSPECTOR_TEST_DEVICE=cuda``
loads the tiny models through the engine onto the GPU and puts the HF references there too, so the
parity tests compare both on the same device, with the tests themselves unchanged: they pass CPU
inputs and read CPU outputs, and this proxy moves both ways. ``GPT_INSPECTOR_TEST_PROXY=1`` wraps
the references on the CPU too, to try the proxy on a machine without a GPU.
"""

from __future__ import annotations

import copy
import os

import torch

DEVICE = os.environ.get("GPT_INSPECTOR_TEST_DEVICE", "cpu")


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_move(v, device) for v in x)
    if isinstance(x, list):
        return [_move(v, device) for v in x]
    if isinstance(x, dict) and not hasattr(x, "to_tuple"):
        return {k: _move(v, device) for k, v in x.items()}
    if hasattr(x, "to_tuple"):  # a ModelOutput: move its fields in place, keep its type and attributes
        for k in list(x.keys()):
            x[k] = _move(x[k], device)
        return x
    return x


class OnDevice:
    """An HF model on ``DEVICE`` that takes and gives CPU tensors; everything else is the model's."""

    def __init__(self, model):
        object.__setattr__(self, "_model", model.to(DEVICE))

    def __call__(self, *args, **kwargs):
        return _move(self._model(*_move(args, DEVICE), **_move(kwargs, DEVICE)), "cpu")

    def forward(self, *args, **kwargs):
        return self(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return _move(self._model.generate(*_move(args, DEVICE), **_move(kwargs, DEVICE)), "cpu")

    def __getattr__(self, name):
        if name == "_model":  # not set yet (a copy under construction)
            raise AttributeError(name)
        return getattr(self._model, name)

    def __deepcopy__(self, memo):
        return OnDevice(copy.deepcopy(self._model, memo))

    def __setattr__(self, name, value):
        setattr(self._model, name, value)


def reference(model):
    return model if DEVICE == "cpu" and not os.environ.get("GPT_INSPECTOR_TEST_PROXY") else OnDevice(model)
