"""Gluon primitives shared by the Hopper kernels (layouts, TMA descriptors, mbarrier rings, the fp32
TMA reduce-add); importable without Gluon (HAVE_GLUON is False: use nothing here)."""
from __future__ import annotations

try:   # Gluon ships with triton >= 3.5
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except Exception:   # pragma: no cover - older triton
    HAVE_GLUON = False

_SHARED_LAYOUTS: dict = {}


def shared_layout(block_shape, dtype):
    """The NVMMA shared layout (swizzle chosen by Gluon) of a TMA box / wgmma operand tile,
    memoized: get_default_for is pure Python and the launchers ask at every call."""
    key = (tuple(block_shape), dtype)
    lay = _SHARED_LAYOUTS.get(key)
    if lay is None:
        lay = _SHARED_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)
    return lay


def gl_dtype(torch_dtype):
    import torch
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
            torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}[torch_dtype]


_DESCRIPTORS: dict = {}


def descriptor_2d(x, rows: int, cols: int, row_stride: int, box):
    """Host TMA descriptor over x seen as a (rows, cols) row-major matrix, box `box`; reads past the
    bounds return zeros, writes past them are dropped. Building one validates its fields (host time
    at every call), so one is built per (rows, cols, stride, box, dtype) and later calls copy it
    with the new base, checking what depends on the base (alignment)."""
    key = (rows, cols, row_stride, tuple(box), x.dtype)
    fields = _DESCRIPTORS.get(key)     # the template's fields without its tensor
    if fields is None:
        desc = TensorDescriptor(x, [rows, cols], [row_stride, 1], list(box),
                                shared_layout(box, gl_dtype(x.dtype)))
        if len(_DESCRIPTORS) >= 1024:      # a bound, for programs that sweep shapes
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = dict(desc.__dict__, base=None)
        return desc
    if x.data_ptr() % 16:
        raise ValueError(f"TMA descriptor: the base of a {tuple(x.shape)} {x.dtype} tensor is not "
                         f"16-byte aligned")
    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(fields, base=x)
    return desc


if HAVE_GLUON:

    @builtin
    def tma_reduce_add(desc, coord, src, _semantic=None):
        """Asynchronous TMA reduce-add of the shared tile `src` into the global box of `desc` at
        `coord` (cp.reduce.async.bulk.tensor ... add; fp32 adds in the L2, unordered between CTAs).
        Call fence_async_shared() after writing src; completion is tracked like a TMA store
        (tma.store_wait)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord,
                                                  src.handle)

    @gluon.constexpr_function
    def wgmma_layout(warps_m, warps_n, n, k):
        """Accumulator layout of a wgmma tile: warps_m x warps_n warps (warpgroups stacked along M
        when warps_m > 4, side by side along N when warps_n > 1), instruction m16 x n x k."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n],
                                         instr_shape=[16, n, k])

    @gluon.jit
    def alloc_barriers(n: gl.constexpr, count: gl.constexpr = 1):
        """A ring of n mbarriers (`count` arrivals per phase) in shared memory, initialized."""
        bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n):
            mbarrier.init(bars.index(i), count=count)
        return bars

    @gluon.jit
    def arrive_synced(bar, pred=True):
        """One arrival on `bar` for the partition (none where pred is false), after the caller's
        gl.thread_barrier(). The 0-byte expect-tx form: Triton 3.6 adds a partition-wide bar.sync
        before a plain arrive and before the next mbarrier wait, both redundant after the
        caller's barrier."""
        mbarrier.expect(bar, 0, pred=pred)

    @gluon.jit
    def named_barrier(bar_id, THREADS: gl.constexpr, ARRIVE: gl.constexpr):
        """`bar.sync bar_id, THREADS` (ARRIVE: `bar.arrive`) by every thread of the calling
        4-warp partition: a sync returns once THREADS threads have arrived (this partition's and
        another's). Ids 0-7 belong to Triton's partitions; callers take 8 and up."""
        one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ids = gl.full([128], 0, gl.int32, one) + bar_id
        gl.inline_asm_elementwise(_bar_asm(ARRIVE, THREADS), "=r,r", [ids], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.constexpr_function
    def _bar_asm(arrive, threads):
        return f"bar.{'arrive' if arrive else 'sync'} $1, {threads}; mov.u32 $0, 0;"

    @gluon.jit
    def _invalidate_ring(ring):
        n: gl.constexpr = ring.type.shape[0]
        for i in gl.static_range(n):
            mbarrier.invalidate(ring.index(i))

    @gluon.jit
    def invalidate_barriers(rings):
        """Invalidate every mbarrier of a tuple of alloc_barriers rings (at the kernel's end)."""
        for r in gl.static_range(len(rings)):
            _invalidate_ring(rings[r])
