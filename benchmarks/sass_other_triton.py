"""sass_loop.py under a newer Triton than the pinned 3.6.0, for comparing SASS per tile.

    python -m venv /tmp/v39 && /tmp/v39/bin/pip install torch==2.13.0 triton==3.9.0 numpy
    PYTHONPATH=. TRITON_DEFAULT_FP_FUSION=1 /tmp/v39/bin/python benchmarks/sass_other_triton.py \
        --kernel dkdv --D 64

Triton 3.7-3.9 renamed three Gluon calls our kernels use; this script aliases the old names to
the new ones before sass_loop.py imports the kernels (nothing else changes, and the library
itself stays on 3.6.0). benchmarks/NOTES.md, session 16 item 1, has what it showed.
"""
from __future__ import annotations

import os
import runpy
import sys

import triton.experimental.gluon.language as gl
from triton.experimental.gluon.language import _core
from triton.experimental.gluon.language.nvidia.hopper import tma

if not hasattr(gl, "thread_barrier"):                       # 3.9: gl.barrier()
    gl.thread_barrier = gl.barrier
if not hasattr(_core.shared_memory_descriptor, "_reinterpret"):   # 3.9: .reinterpret()
    _core.shared_memory_descriptor._reinterpret = _core.shared_memory_descriptor.reinterpret
if hasattr(tma, "async_load"):                              # 3.9: async_load / async_store
    tma.async_copy_global_to_shared = tma.async_load
    tma.async_copy_shared_to_global = tma.async_store

here = os.path.dirname(os.path.abspath(__file__))
sys.argv = [os.path.join(here, "sass_loop.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
