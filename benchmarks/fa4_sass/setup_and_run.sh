#!/usr/bin/env bash
# CPU-only: build a Python 3.11 venv with FA4 4.0.0b36 + CuTe DSL 4.8.1 (cp311 wheels), compile the
# SM90 bf16 backward and forward (causal, varlen, 32q/8kv heads) for hdim 128 and 64, and disassemble + analyse.
#   bash benchmarks/fa4_sass/setup_and_run.sh [WORKDIR=/tmp/fa4sass]    # SASS etc. under WORKDIR/out
set -euo pipefail
W=${1:-/tmp/fa4sass}; HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../.." && pwd)
FA4B=${FA4B:-$ROOT/.fa4/b}   # ../shared/tools/fa4_wheels.sh builds it
mkdir -p "$W/whl311"; cd "$W"
cp "$HERE"/fa4_compile.py "$HERE"/compile_fa4_bwd.py "$HERE"/compile_fa4_fwd.py "$HERE"/analyze_sass.py .
if [ ! -x venv/bin/python ]; then
  python3.11 -m venv venv
  . venv/bin/activate
  pip install -q torch==2.13.0 numpy einops protobuf triton "cuda-bindings>=13,<14"
  pip download -q --no-deps -d whl311 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
      apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 "nvidia-cuda-nvdisasm>=13.4.0rc1,<14"
  pip install -q --no-deps whl311/*.whl "$FA4B"/flash_attn_4-4.0.0b36-py3-none-any.whl \
      "$FA4B"/nvidia_cutlass_dsl-4.8.1-py3-none-any.whl "$FA4B"/nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl \
      "$FA4B"/quack_kernels-0.6.5-py3-none-any.whl
fi
. venv/bin/activate
export TRITON_NV_BIN=${TRITON_NV_BIN:-$(ls -d "$ROOT"/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin | head -1)}  # cuobjdump
for h in 128 64; do
  python compile_fa4_bwd.py $h out/hd$h
  for f in out/hd$h/*.sass; do python analyze_sass.py "$f" --dump out/hd$h/loops > "${f%.sass}.analysis.txt"; done
done
# forward (FA4's default sm90 config: hd128 128x128, hd64 192x128, pack_gqa, RS, intra-WG overlap)
for h in 128 64; do
  rm -rf out/hd${h}_fwd/loops
  python compile_fa4_fwd.py $h out/hd${h}_fwd
  for f in out/hd${h}_fwd/*.sass; do python analyze_sass.py "$f" --dump out/hd${h}_fwd/loops > "${f%.sass}.analysis.txt"; done
done
