"""A tensor that was on a CUDA device, arriving in a process without CUDA (this machine: no
GPU): it lands on the CPU with one warning, whatever it was (a Parameter keeps its class and
``requires_grad``). The sending side needs a GPU: ``tests/test_gpu.py`` covers it there."""

from __future__ import annotations

import logging
import pickle

import pytest

from ktlite_wire import codec


def test_a_cuda_tagged_tensor_lands_on_the_cpu_with_one_warning(torch, monkeypatch, caplog):
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA: tests/test_gpu.py checks that case")
    monkeypatch.setattr(codec, "_warned_cpu", set())
    data = torch.arange(6, dtype=torch.float32)
    buf = pickle.PickleBuffer(data.numpy().view("uint8"))
    with caplog.at_level(logging.WARNING, logger="ktlite_wire.codec"):
        plain = codec._rebuild_tensor(buf, "float32", (2, 3), False, False, "cuda:1")
        param = codec._rebuild_tensor(buf, "float32", (6,), True, True, "cuda:1")
    assert plain.device.type == "cpu" and plain.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert caplog.text.count("arrived in a process without that CUDA device") == 1
    assert "cuda:1" in caplog.text
