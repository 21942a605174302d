"""Setup for the GPU tests: real kernels only (never the interpreter), exact fp32 references."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") == "1" and torch.cuda.is_available():
    raise RuntimeError("tests/gpu run the compiled kernels: unset TRITON_INTERPRET")

# The references multiply in fp32/fp64: no TF32 anywhere.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (H200)")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _free_cuda_memory():
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
