"""How many builds (JIT specializations) the fp8 and bf16 kernel paths ask for over the GPU
fuzz's random cases (tests/_kvblock.random_case), on the CPU: each launch is bound as on an
sm_90 GPU (Triton's own binder: ints specialized on == 1 and on divisibility by 16), nothing is
compiled or run. A Gluon kernel build takes seconds, so on a machine with a cold cache the
number of builds, not the kernels, sets how long the GPU fuzz runs.

    python benchmarks/jit_variants.py [--cases 100] [--seed 20261203]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=20261203)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("needs TRITON_INTERPRET unset (real JIT functions)")
    from triton.runtime.jit import JITFunction

    from benchmarks.tools.compile import bind_for
    from flamia.inputs import cu_seqlens_from_lengths
    from flamia.ops.backward_sm90 import attention_backward_sm90, attention_backward_sm90_fp8
    from flamia.ops.config import PersistentFwdConfig, triton_forward_config
    from flamia.ops.forward import attention_forward
    from flamia.ops.quantize import quantize_qkv
    from tests._kvblock import random_case

    seen = collections.defaultdict(set)

    def bind(fn, *a, grid, warmup, **kw):
        spec = bind_for(fn, a, kw)[3]
        seen[fn.__name__].add((str(spec), tuple(sorted((k, str(v)) for k, v in kw.items()))))

    JITFunction.run = bind
    rng = random.Random(args.seed)
    cuda = torch.device("cuda")
    for _ in range(args.cases):
        lengths, Hq, Hkv, D, causal = random_case(rng)
        T = sum(lengths)
        cu = cu_seqlens_from_lengths(lengths)
        q, k, v, do = (torch.zeros(T, h, D, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
        qkv = quantize_qkv(q, k, v, cu, "fp8", causal)
        cfg = PersistentFwdConfig() if D == 128 else triton_forward_config(D, True, cuda)
        out, lse, row_max = attention_forward(qkv, cu, max(lengths), causal, None, torch.bfloat16,
                                              return_row_max=True, config=cfg)
        qkv = dataclasses.replace(qkv, row_max=row_max)
        attention_backward_sm90_fp8(do, out, lse, row_max, qkv, cu, causal)
        attention_backward_sm90(do, out, lse, q, k, v, cu, causal)
    print(f"builds over {args.cases} fuzz cases (seed {args.seed}):")
    for name, keys in sorted(seen.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(keys):5d}  {name}")


if __name__ == "__main__":
    main()
