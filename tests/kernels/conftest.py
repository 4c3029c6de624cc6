"""Kernel tests run on CPU through the Triton interpreter, or natively on a GPU.

TRITON_INTERPRET must be set before ``kernels`` defines its kernels, so it is set here,
before anything imports ``kernels``.  ``KERNELS_TEST_DEVICE=cuda`` (what scripts/gpu_check.py
sets) runs the same tests compiled on the GPU instead.
"""
import os

import pytest

DEVICE = os.environ.get("KERNELS_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import kernels  # noqa: E402


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def triton_device(device):
    """The device for Triton-kernel tests; skips when the kernels cannot run there."""
    if not kernels.triton_available(device):
        pytest.skip(f"Triton kernels unavailable on {device} (interpreted={kernels.interpreted()}; "
                    "was kernels imported before TRITON_INTERPRET was set?)")
    return device


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
