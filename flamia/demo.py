"""`flamia demo`: accuracy of every recipe against float64, the leakage audit, and (on CUDA) speed.

Runs on embedded defaults, on the GPU when there is one, else on the CPU (a few seconds there:
2.5 s on 2 cores). The header lists every recipe with what runs it here (kernels or the reference
emulation, and why) and what the run skips.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import audit as _audit
from .inputs import FAMILIES, make_qkv, rel_err
from .cli import ArgumentParser, device_type, handles_usage_errors, resolve_device
from .interface import KERNEL_HEAD_DIMS, backend, flamia_attn_func, flamia_attn_varlen_func
from .recipes import RECIPES
from .reference import attention_exact

CPU_CONFIG = dict(lengths=(300, 17, 1, 0, 200), heads_q=4, heads_kv=2, head_dim=64)
GPU_CONFIG = dict(lengths=(2048, 700, 17, 1, 0, 1300), heads_q=16, heads_kv=4, head_dim=128)
AUDITED = ("fp8", "fp8_mixed", "fp8_tensorwise")


class Progress:
    """A one-line-per-step progress display with elapsed time (no dependency)."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        print(f"  [{self.done:2d}/{self.total}] {time.perf_counter() - self.t0:6.1f}s  {what}", flush=True)


def accuracy_table(lengths, heads_q, heads_kv, head_dim, device, recipes=tuple(RECIPES),
                   families=FAMILIES, seed=0, progress: Progress | None = None):
    """Relative Frobenius errors of O, dQ, dK, dV vs float64, through the public API.

    Returns {(family, recipe): (o, dq, dk, dv)}. Inputs bf16 from flamia.inputs.make_qkv, dO
    standard normal, causal, packed documents.
    """
    results = {}
    T = sum(lengths)
    for family in families:
        q, k, v, cu = make_qkv(lengths, heads_q, heads_kv, head_dim, family, torch.bfloat16, device, seed)
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        do = torch.randn(T, heads_q, head_dim, generator=gen).to(device=device, dtype=torch.bfloat16)
        x64 = [x.double().requires_grad_() for x in (q, k, v)]
        o64 = attention_exact(*x64, cu)
        ref = (o64.detach(), *torch.autograd.grad(o64, x64, do.double()))
        if progress:
            progress.step(f"float64 reference, {family}")
        for name in recipes:
            xs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = flamia_attn_varlen_func(*xs, cu, cu, max(lengths), max(lengths), recipe=name)
            grads = torch.autograd.grad(out, xs, do)
            errs = tuple(rel_err(a, b) for a, b in zip((out, *grads), ref))
            results[(family, name)] = errs
            if progress:
                progress.step(f"{name:15s} {family:9s} O {errs[0]:.3g}  dQ {errs[1]:.3g}  "
                              f"dK {errs[2]:.3g}  dV {errs[3]:.3g}")
    return results


def format_accuracy(results) -> str:
    lines = ["| inputs | recipe | O | dQ | dK | dV |", "| --- | --- | --- | --- | --- | --- |"]
    for (family, name), errs in results.items():
        lines.append(f"| {family} | {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
    return "\n".join(lines)


def time_call(fn, warmup=3, iters=20) -> float:
    """Median milliseconds of fn() over CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def speed_table(batch=1, seqlen=8192, heads_q=32, heads_kv=8, head_dim=128) -> str:
    """fwd and fwd+bwd medians of flamia_attn_func for fp8 vs bf16 (and torch SDPA for context)."""
    dev = "cuda"
    q = torch.randn(batch, seqlen, heads_q, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, seqlen, heads_kv, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    flops_fwd = 4 * batch * heads_q * seqlen * seqlen * head_dim / 2   # causal
    rows = ["| impl | backend | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s |", "| --- | --- | --- | --- | --- |"]

    def add(label, be, f):
        def fb():
            out = f()
            torch.autograd.grad(out, (q, k, v), do)
        with torch.no_grad():
            t_f = time_call(f)
        t_fb = time_call(fb)
        rows.append(f"| {label} | {be} | {t_f:.3f} | {t_fb:.3f} | {3.5 * flops_fwd / t_fb / 1e9:.0f} |")

    for name in ("bf16", "fp8"):
        be = backend(q, name)
        if be != "kernels":
            rows.append(f"| flamia {name} | {be} | skipped: kernels not available | | |")
            continue
        add(f"flamia {name}", be, lambda name=name: flamia_attn_func(q, k, v, recipe=name, check_finite=False))

    def sdpa():
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)
    add("torch SDPA bf16", "torch", sdpa)
    return (f"B={batch}, S={seqlen}, Hq={heads_q}, Hkv={heads_kv}, D={head_dim}, causal, bf16 in/out\n"
            + "\n".join(rows))


def recipe_path(device, head_dim: int, name: str) -> str:
    """Which implementation runs recipe `name` for this device and head dim, and why."""
    import os

    from . import ops
    from .ops.config import ReferenceBwdConfig, backward_config
    probe = torch.empty(1, 1, head_dim, device=device)
    rec = RECIPES[name]
    if backend(probe, name) == "kernels":
        if probe.is_cuda and ops.is_sm90(probe.device):
            return "kernels: Triton and Gluon (sm_90)"
        where = ("Triton (not sm_90: no Gluon kernels)" if probe.is_cuda
                 else "Triton under its interpreter (TRITON_INTERPRET=1 FLAMIA_KERNELS=1)")
        if isinstance(backward_config(head_dim, name, probe.device), ReferenceBwdConfig):
            where += "; the backward on the reference (its kernel needs sm_90)"
        return f"kernels: {where}"
    ref = "reference emulation (flamia/reference.py, fp32)"
    if name not in ops.KERNEL_RECIPES:
        why = ("the leaky control has no kernel" if rec.leaky
               else "emulated Blackwell format, no Hopper kernel" if rec.emulated and rec.scaling == "block"
               else "a reference-only spec, no kernel" if rec.emulated
               else "no kernel for this recipe")
    elif os.environ.get("FLAMIA_KERNELS", "") == "0":
        why = "FLAMIA_KERNELS=0"
    elif not probe.is_cuda:
        why = "no CUDA GPU (the kernels need one)"
    elif head_dim not in KERNEL_HEAD_DIMS:
        why = f"head dim {head_dim} (kernels: {KERNEL_HEAD_DIMS})"
    else:
        why = "the kernels cannot be imported here"
    return f"{ref}: {why}"


@handles_usage_errors("flamia demo")
def main(argv=None) -> int:
    parser = ArgumentParser(prog="flamia demo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_type, default="auto",
                        help="auto, cpu, cuda or cuda:N (default auto: cuda when available)")
    parser.add_argument("--no-speed", action="store_true", help="skip the CUDA timing")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    cuda = device.startswith("cuda")
    cfg = GPU_CONFIG if cuda else CPU_CONFIG
    lengths = cfg["lengths"]
    print(f"flamia demo on {device}: causal attention over packed documents {list(lengths)} "
          f"(T={sum(lengths)}), {cfg['heads_q']} query / {cfg['heads_kv']} kv heads, head dim "
          f"{cfg['head_dim']}, bf16 inputs")
    print(f"recipes (all {len(RECIPES)} in the accuracy table), and what runs each here:")
    for name in RECIPES:
        print(f"  {name:15s} {recipe_path(device, cfg['head_dim'], name)}")
    print(f"runs: 1. accuracy of every recipe; 2. leakage audit of {', '.join(AUDITED)} "
          f"(`flamia audit` audits every recipe)")
    skipped = None if cuda and not args.no_speed else (
        "--no-speed" if args.no_speed else "no CUDA GPU: it times the kernels with CUDA events")
    print(f"skipped: 3. speed ({skipped})" if skipped else "then: 3. speed (fp8 and bf16 vs torch SDPA)")

    print("\n1. Accuracy: relative Frobenius error vs float64 attention (forward O, gradients dQ dK dV)")
    progress = Progress(len(RECIPES) * len(FAMILIES) + len(FAMILIES) + len(AUDITED))
    results = accuracy_table(cfg["lengths"], cfg["heads_q"], cfg["heads_kv"], cfg["head_dim"], device,
                             progress=progress)

    print("\n2. Leakage audit: perturb the future (P1) or another document (P2), look for any change")
    reports = []
    for name in AUDITED:
        rep = _audit.audit(_audit.recipe_fn(name), heads_q=cfg["heads_q"], heads_kv=cfg["heads_kv"],
                           head_dim=cfg["head_dim"], device=device)
        reports.append(rep)
        progress.step(f"audit {name}: {'PASS' if rep.passed else 'LEAK'}")

    print("\nAccuracy (lower is better; mild = standard normal, outliers = hot channels and tokens):")
    print(format_accuracy(results))
    print("\nAudit:")
    for name, rep in zip(AUDITED, reports):
        print(f"\n{rep}")
        if RECIPES[name].leaky:
            print("  (the leaky control: LEAK is the expected verdict)")
    if skipped:
        print(f"\n3. Speed: skipped ({skipped})")
    else:
        print("\n3. Speed (median over CUDA events):")
        print(speed_table())
    ok = all(r.passed != RECIPES[n].leaky for n, r in zip(AUDITED, reports))
    print("\ndemo finished:", "all audit verdicts as expected" if ok else "UNEXPECTED audit verdict")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
