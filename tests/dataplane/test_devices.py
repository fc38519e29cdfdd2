"""Devices as the engine keeps them (devices.py): the first GPU run found `cuda` and `cuda:0`
compared unequal, so the LoRA layers refused their pool and slot tables were rebuilt per call."""

from __future__ import annotations

import pytest
import torch

from loraplane.dataplane.devices import same_device, torch_device


def test_cpu_devices_pass_through_and_compare_equal() -> None:
    assert torch_device("cpu") == torch.device("cpu")
    assert same_device(torch.device("cpu"), torch_device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_cuda_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="torch sees no CUDA device; use --device cpu"):
        torch_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_unindexed_cuda_device_is_the_current_one() -> None:
    current = torch.device("cuda", torch.cuda.current_device())
    assert torch.device("cuda") != current  # what torch does, and why this module exists
    assert torch_device("cuda") == current == torch.zeros(1, device="cuda").device
    assert same_device(torch.device("cuda"), current)
