"""Test setup shared by every CPU test.

Without CUDA, the real Triton kernels run under Triton's interpreter: TRITON_INTERPRET=1 must be
set before anything imports triton, and FLAMIA_KERNELS=1 makes flamia.ops.kernels_available()
route the kernel recipes (fp8, bf16) to them (see flamia/ops/__init__.py). Tests that
must run the reference emulation regardless call flamia.reference directly or use the
`reference_only` fixture.
"""
from __future__ import annotations

import os


def _cuda_available() -> bool:
    # Ask the driver without importing triton; torch does not import triton at import time.
    import torch
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FLAMIA_KERNELS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def fake_capability(monkeypatch):
    """fake_capability(cap, name): every CUDA device reports compute capability `cap`, to torch
    and to flamia.ops' memo of device properties (what config selection asks), with 132 SMs and
    the name `name` (an H100's by default)."""
    def fake(cap, name="NVIDIA H100 80GB HBM3"):
        from flamia import ops
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
        monkeypatch.setattr(ops, "_properties", lambda index: (cap, 132, name))
    return fake


@pytest.fixture
def reference_only(monkeypatch):
    """Run the public API on the reference emulation even where kernels are available."""
    monkeypatch.setenv("FLAMIA_KERNELS", "0")


# What the Triton interpreter's NumPy arithmetic says about the NaN / Inf that tests marked
# `nonfinite` feed the kernels on purpose; ignored in those tests only, by message and module.
NONFINITE_WARNINGS = (
    "ignore:All-NaN slice encountered:RuntimeWarning:triton.runtime.interpreter",
    "ignore:invalid value encountered in:RuntimeWarning:triton.runtime.interpreter",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("nonfinite"):
            for spec in NONFINITE_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))
