"""Development check of the sm90 one-pass backward on the H200: correctness against float64 and
timing against the current bf16 backward and FlashAttention-4 (when importable), one process.

    python benchmarks/bwd_sm90_dev.py [--check] [--time] [--workloads a,b] [--configs ...]

--check: random packed cases (0/1/2-token documents, GQA, D 64/128, causal and not); outputs
poisoned with NaN first (the allocator hands the NaN-filled blocks back); relative Frobenius
error of dq, dk, dv vs float64 within 2x bf16's 2.5e-3 (+1e-3); P2: a
perturbed document leaves every other document's dk / dv bitwise unchanged and dq unchanged up to
the order of the fp32 adds.
--time: backward median ms (CUDA events) per workload: sm90 kernel (pre + main + post), copies
of backward_sm90.py (--ab), FA4 (fwd+bwd minus fwd, autograd), and TFLOP/s; --fp8 adds the fp8
recipe's one-pass kernel on quantize_qkv's operands.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from flamia.inputs import cu_seqlens_from_lengths  # noqa: E402
from flamia.ops import backward_sm90 as B  # noqa: E402
from flamia.ops.config import Sm90BwdConfig, sm90_backward_config  # noqa: E402
from flamia.reference import attention_exact, lse_exact  # noqa: E402


def ref_attention(q, k, v, do, cu, causal, scale):
    """float64 out, lse (Hq, T), dq, dk, dv: flamia.reference's exact attention, autograd."""
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    o = attention_exact(qd, kd, vd, cu, causal, scale)
    dq, dk, dv = torch.autograd.grad(o, (qd, kd, vd), do.double())
    return o.detach(), lse_exact(q, k, cu, causal, scale), dq, dk, dv


def case_inputs(g, D, Hq, Hkv, lengths, causal, scale):
    """Random bf16 q, k, v, dO of a packed case (generator g) on the GPU, cu_seqlens, the
    float64 reference's out (bf16) and lse (fp32), and its (dq, dk, dv)."""
    T = sum(lengths)
    q, k, v, do = (torch.randn(T, h, D, generator=g).to(torch.bfloat16).cuda()
                   for h in (Hq, Hkv, Hkv, Hq))
    cu = cu_seqlens_from_lengths(lengths, device="cuda")
    o64, lse64, dq64, dk64, dv64 = ref_attention(q, k, v, do, cu, causal, scale)
    return q, k, v, do, cu, o64.to(torch.bfloat16), lse64.float().contiguous(), (dq64, dk64, dv64)


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def p2_perturbed(fn, new, q, k, v, do, o, lse, cu, lengths):
    """P2 of a backward fn(do, o, lse, q, k, v, cu) -> (dq, dk, dv) whose outputs on these inputs
    are `new`: the longest document's q, k, v, dO redrawn (x3); every other document's dk / dv
    must be bitwise unchanged and dq unchanged up to the order of fp32 adds. Returns (text, ok);
    "-" with a single non-empty document."""
    if len([L for L in lengths if L]) <= 1:
        return "-", True
    T = q.shape[0]
    j = max(range(len(lengths)), key=lambda i: lengths[i])
    a, b = sum(lengths[:j]), sum(lengths[:j + 1])
    q2, k2, v2, do2 = (x.clone() for x in (q, k, v, do))
    for x in (q2, k2, v2, do2):
        x[a:b] = torch.randn_like(x[a:b], dtype=torch.float32).to(x.dtype) * 3
    new2 = fn(do2, o.clone(), lse.clone(), q2, k2, v2, cu)
    keep = torch.ones(T, dtype=torch.bool, device=q.device)
    keep[a:b] = False
    bit = all(torch.equal(x[keep], y[keep]) for x, y in zip(new[1:], new2[1:]))
    dq_close = torch.allclose(new[0][keep].float(), new2[0][keep].float(), rtol=1e-2, atol=1e-3)
    ok = bit and dq_close
    return ("ok" if ok else f"FAIL(bit={bit},dq={dq_close})"), ok


def poison():
    """Fill free cached blocks with NaN so that torch.empty hands out NaN memory."""
    blocks = []
    try:
        free = torch.cuda.mem_get_info()[0]
        n = min(free // 4, 8 << 30) // 4
        blocks.append(torch.full((n,), float("nan"), device="cuda"))
    except RuntimeError:
        pass
    del blocks


def check(seed: int, configs):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for D in (64, 128):
        cases += [
            (D, 4, 4, [1, 0, 2, 131, 257, 64], True),
            (D, 8, 2, [700, 17, 1, 0, 330], True),
            (D, 6, 3, [513], False),
            (D, 4, 1, [128, 256, 3, 200], True),
            (D, 2, 2, [2049], True),
        ]
    rows = []
    for (D, Hq, Hkv, lengths, causal) in cases:
        scale = D ** -0.5
        q, k, v, do, cu, o, lse, (dq64, dk64, dv64) = case_inputs(g, D, Hq, Hkv, lengths,
                                                                  causal, scale)
        for cfg in configs(D):
            poison()
            new = B.attention_backward_sm90(do, o, lse, q, k, v, cu, causal, scale, config=cfg)
            torch.cuda.synchronize()
            errs = [rel(x, r) for x, r in zip(new, (dq64, dk64, dv64))]
            bars = [2.5e-3] * 3     # the bar: 2x bf16's error at these sizes
            finite = all(torch.isfinite(x).all().item() for x in new)
            ok = finite and all(e <= 2 * eo + 1e-3 for e, eo in zip(errs, bars))
            # P2: perturb the longest document; every other document bitwise (dk, dv)
            p2, p2_ok = p2_perturbed(
                lambda do_, o_, lse_, q_, k_, v_, cu_: B.attention_backward_sm90(
                    do_, o_, lse_, q_, k_, v_, cu_, causal, scale, config=cfg),
                new, q, k, v, do, o, lse, cu, lengths)
            ok = ok and p2_ok
            # deterministic mode: bitwise reproducible, and the same function
            det = [B.attention_backward_sm90(do, o, lse, q, k, v, cu, causal, scale,
                                             deterministic=True, config=cfg) for _ in range(2)]
            det_ok = all(torch.equal(x, y) for x, y in zip(*det)) and all(
                torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-3)
                for x, y in zip(det[0], new))
            ok = ok and det_ok
            p2 += f" det={'ok' if det_ok else 'FAIL'}"
            rows.append((f"D{D} {Hq}/{Hkv} {'c' if causal else 'nc'} {lengths}",
                         f"m{cfg.block_m}n128", errs, bars, finite, p2, ok))
            print(f"{'PASS' if ok else 'FAIL'} D={D} H={Hq}/{Hkv} causal={causal} L={lengths} "
                  f"m{cfg.block_m}n128: dq/dk/dv {errs[0]:.2e}/{errs[1]:.2e}/{errs[2]:.2e} "
                  f"finite={finite} P2={p2}",
                  flush=True)
    return all(r[-1] for r in rows)


def cuda_ms(fn, warmup=3, reps=20, target_s=1.0):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = int(max(5, min(reps, target_s / max(one, 1e-6))))
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def fa4_fn():
    try:
        from flash_attn.cute import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        print(f"FA4 not importable: {type(e).__name__}: {e}"[:300])
        return None


def fp8_timing_inputs(q, k, v, cu, causal):
    """The fp8 recipe's quantized operands (flamia.ops.quantize.quantize_qkv: block and
    diagonal copies, vnorm) for timing its one-pass backward alone."""
    from flamia.ops.quantize import quantize_qkv
    return quantize_qkv(q, k, v, cu, "fp8", causal)


def interleaved_ms(variants: dict, rounds: int, timer=None, per_round: dict | None = None) -> dict:
    """{name: (median ms, spread %)} of the calls in `variants` timed in `rounds` rounds, each
    round every variant once (a block of calls, `timer`: cuda_ms over ~0.25 s), the order reversed
    every other round; spread = (max - min) / median over the rounds. per_round, if given,
    receives {name: [ms of each round]} (for paired_ratios)."""
    timer = timer or (lambda fn: cuda_ms(fn, target_s=0.25))
    times = {n: [] for n in variants}
    order = list(variants)
    for r in range(rounds):
        for n in (order if r % 2 == 0 else order[::-1]):
            times[n].append(timer(variants[n]))
    if per_round is not None:
        per_round.update(times)
    out = {}
    for n, ts in times.items():
        med = statistics.median(ts)
        out[n] = (med, 100 * (max(ts) - min(ts)) / med if med else 0.0)
    return out


def paired_ratios(times: dict, pairs: dict) -> dict:
    """{variant: (median, min, max) of variant / base over the rounds} for pairs {variant: base}:
    each round's ratio compares two blocks timed next to each other, so the machine's drift over
    the run (clocks under power, the spread above) cancels where it is slow against a round."""
    out = {}
    for n, base in pairs.items():
        if n in times and base in times:
            rs = [a / b for a, b in zip(times[n], times[base]) if b]
            if rs:
                out[n] = (statistics.median(rs), min(rs), max(rs))
    return out


PAIR_COPIES = False   # --pair-copies: each --ab copy against this tree's library instead


def ab_pairs(names) -> dict:
    """{variant: base}: each of this tree's bf16 / fp8 variants against the first --ab copy of
    the same recipe (names as time_workloads gives them); with PAIR_COPIES each --ab copy (bf16
    and fp8) against this tree's variant of its recipe (copy / library: the abp stage, where the
    copies are the patches)."""
    bases = list(AB_BASE)
    if not bases:
        return {}
    lib = [n for n in names if n.startswith(("sm90 ", "fp8 ")) and not n.endswith(" det")]
    if PAIR_COPIES:
        l16 = next((n for n in lib if n.startswith("sm90 ")), None)
        l8 = next((n for n in lib if n.startswith("fp8 ")), None)
        d16 = next((n for n in names if n.startswith("sm90 ") and n.endswith(" det")), None)
        out = {}
        for b in bases:
            out[b] = l16
            out[f"{b} fp8"] = l8
            out[f"{b} det"] = d16               # deterministic mode (--det): copy / library
            out[f"{b} fp8 det"] = "fp8 det"
        return {n: base for n, base in out.items() if base and n in names and base in names}
    b16, b8 = bases[0], f"{bases[0]} fp8"
    return {n: (b8 if n.startswith("fp8 ") else b16) for n in lib}


def time_workloads(names, configs, causal=True, args_det=False, shapes=(), fp8=False,
                   rounds=3, both_modes=False):
    """Per workload, every variant (the --ab copies and the library, bf16 and with fp8 the fp8
    recipe, deterministic mode with args_det, FA4 when importable) timed in `rounds` interleaved
    rounds, the order reversed every other round (a variant's block of calls is ~0.25 s): the
    median over rounds, and the spread (max - min) / median in percent, so that a difference
    between copies can be told from the machine's drift."""
    wl = json.load(open(os.path.join(os.path.dirname(__file__), "..", "flamia", "data",
                                     "workloads.json")))["workloads"]
    for spec in shapes:     # name:Hq:Hkv:D:L1+L2+...
        name, hq, hkv, d, ls = spec.split(":")
        wl.append({"name": name, "heads_q": int(hq), "heads_kv": int(hkv), "head_dim": int(d),
                   "doc_lengths": [int(x) for x in ls.split("+")]})
        names = names and names + [name]
    fa4 = fa4_fn()
    table = []
    for w in wl:
        if names and w["name"] not in names:
            continue
        lengths, Hq, Hkv, D = w["doc_lengths"], w["heads_q"], w["heads_kv"], w["head_dim"]
        T = sum(lengths)
        scale = D ** -0.5
        flops_f = sum(4 * Hq * D * L * L / 2 for L in lengths)
        flops_b = 2.5 * flops_f
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, h, D, device="cuda", generator=g).to(torch.bfloat16)
                       for h in (Hq, Hkv, Hkv, Hq))
        cu = cu_seqlens_from_lengths(lengths, device="cuda")
        maxlen = max(lengths)
        import flamia
        o, lse = flamia.flamia_attn_varlen_func(q, k, v, cu, cu, maxlen, maxlen, recipe="bf16",
                                                return_lse=True, check_finite=False)
        variants = {}       # name -> a call to time
        for name, mod in AB_BASE.items():
            variants[name] = functools.partial(mod.attention_backward_sm90, do, o, lse, q, k, v,
                                               cu, causal, scale)
            if args_det:
                variants[f"{name} det"] = functools.partial(
                    mod.attention_backward_sm90, do, o, lse, q, k, v, cu, causal, scale,
                    deterministic=True)
        for cfg in configs(D):
            variants[f"sm90 m{cfg.block_m}n128"] = functools.partial(
                B.attention_backward_sm90, do, o, lse, q, k, v, cu, causal, scale, config=cfg)
            if args_det:
                variants[f"sm90 m{cfg.block_m}n128 det"] = functools.partial(
                    B.attention_backward_sm90, do, o, lse, q, k, v, cu, causal, scale,
                    deterministic=True, config=cfg)
        for hook in EXTRA_VARIANTS:     # other kernels' variants (e.g. cute_bwd_sm90.py)
            variants.update(hook(do, o, lse, q, k, v, cu, causal, scale, D))
        if fp8:
            # the bf16 forward's out and lse stand in for fp8's, lse for its row max: the values
            # do not change the kernel's work
            qkv8 = fp8_timing_inputs(q, k, v, cu, causal)
            lse_b = lse.contiguous()
            fp8_args = (do, o, lse_b, lse_b, qkv8, cu, causal, scale)
            # the --configs tiles, as for the bf16 kernel, with the library's choice for this
            # max_seqlen of where Q^T / dO^T are made
            onchip = sm90_backward_config(D, maxlen).fp8_kmajor_onchip
            for cfg in configs(D):
                variants[f"fp8 m{cfg.block_m}n128"] = functools.partial(
                    B.attention_backward_sm90_fp8, *fp8_args,
                    config=dataclasses.replace(cfg, fp8_kmajor_onchip=onchip))
                if both_modes and D == 128:     # the other choice as well
                    variants[f"fp8 m{cfg.block_m}n128 onchip={not onchip}"] = functools.partial(
                        B.attention_backward_sm90_fp8, *fp8_args,
                        config=dataclasses.replace(cfg, fp8_kmajor_onchip=not onchip))
            want = (B.attention_backward_sm90_fp8(*fp8_args, deterministic=True)
                    if AB_BASE else None)
            for name, mod in AB_BASE.items():
                # deterministic mode: a copy that reorders no add gives the same bits
                got = mod.attention_backward_sm90_fp8(*fp8_args, deterministic=True)
                print(f"{w['name']} {name} fp8 deterministic grads bitwise the library's:",
                      [bool(torch.equal(a, b)) for a, b in zip(got, want)], flush=True)
                # the copy under the library's config for this max_seqlen (the same mode of
                # Q^T / dO^T as the working tree's variant), built by this tree's config module
                variants[f"{name} fp8"] = functools.partial(
                    mod.attention_backward_sm90_fp8, *fp8_args,
                    config=sm90_backward_config(D, maxlen))
                if args_det:
                    variants[f"{name} fp8 det"] = functools.partial(
                        mod.attention_backward_sm90_fp8, *fp8_args, deterministic=True,
                        config=sm90_backward_config(D, maxlen))
            if args_det:
                variants["fp8 det"] = functools.partial(B.attention_backward_sm90_fp8, *fp8_args,
                                                        deterministic=True)
        if fa4 is not None:
            qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))

            def f_fwd():
                r = fa4(qa, ka, va, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=maxlen,
                        max_seqlen_k=maxlen, causal=causal)
                return r[0] if isinstance(r, tuple) else r

            def f_fb():
                out = f_fwd()
                out.backward(do)
                qa.grad = ka.grad = va.grad = None
            try:
                f_fb()
                variants["fa4 fwd"], variants["fa4 fwd+bwd"] = f_fwd, f_fb
            except Exception as e:  # noqa: BLE001
                print(f"FA4 failed on {w['name']}: {type(e).__name__}: {e}"[:300])
        row = {"workload": w["name"]}
        times: dict = {}
        for n, (ms, spread) in interleaved_ms(variants, rounds, per_round=times).items():
            row[n] = ms
            row["_spread " + n] = spread
        for n, (med, lo, hi) in paired_ratios(times, ab_pairs(variants)).items():
            row["_paired " + n] = [med, lo, hi]
        if "fa4 fwd" in row:
            row["fa4 bwd"] = row.pop("fa4 fwd+bwd") - row["fa4 fwd"]
            row.pop("_spread fa4 fwd+bwd")
        row["_tflop_b"] = flops_b / 1e12
        table.append(row)
        print(json.dumps(row), flush=True)
    keys = []
    for r in table:
        keys += [k for k in r if not k.startswith("_") and k not in keys]
    print(f"\nms (TFLOP/s; spread over {rounds} rounds, % of the median)")
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for r in table:
        cells = [r["workload"]]
        for k in keys[1:]:
            if k in r:
                ms = r[k]
                tf = r["_tflop_b"] / (ms / 1e3) if "fwd" not in k else float("nan")
                sp = r.get("_spread " + k)
                cells.append(f"{ms:.3f} ({tf:.0f}" + (f"; {sp:.1f} %)" if sp is not None else ")"))
            else:
                cells.append("-")
        print("| " + " | ".join(cells) + " |")
    paired = [k for k in keys if any("_paired " + k in r for r in table)]
    if paired:
        print(f"\npaired: each variant / its base (--pair-copies: copy / library), per round; "
              f"median [min, max] over {rounds} rounds")
        print("| workload | " + " | ".join(paired) + " |")
        print("|" + " --- |" * (len(paired) + 1))
        for r in table:
            cells = [r["workload"]]
            for k in paired:
                v = r.get("_paired " + k)
                cells.append(f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]" if v else "-")
            print("| " + " | ".join(cells) + " |")
    return table


AB_BASE = {}     # --ab FILE,...: other versions of backward_sm90.py, timed next to this one
EXTRA_VARIANTS = []     # f(do, o, lse, q, k, v, cu, causal, scale, D) -> {name: call}


def load_ab_base(path, name="ab_base"):
    """The module in `path` (a copy of flamia/ops/backward_sm90.py, e.g. `git show
    HEAD~1:flamia/ops/backward_sm90.py > x.py`) imported inside flamia.ops, so its relative
    imports resolve."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"flamia.ops.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ab", default="", help="time these copies of backward_sm90.py (comma "
                    "separated) next to it, each named by its file")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--workloads", default="")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--configs", default="", help="D:BM,... (default: the "
                    "selected config per head dim)")
    ap.add_argument("--det", action="store_true", help="also time deterministic mode (the "
                    "library's and each --ab copy's; --pair-copies pairs them)")
    ap.add_argument("--shapes", default="", help="extra workloads name:Hq:Hkv:D:L1+L2+..., "
                    "comma separated")
    ap.add_argument("--fp8", action="store_true", help="also time the fp8 recipe's one-pass "
                    "backward (at each --configs tile)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per "
                    "workload (median and spread reported)")
    ap.add_argument("--pair-copies", action="store_true", help="paired ratios of each --ab "
                    "copy against this tree (copy / library) instead of this tree against the "
                    "first copy")
    ap.add_argument("--both-modes", action="store_true", help="with --fp8 at D=128: also the "
                    "other choice of config.fp8_kmajor_onchip than the library's")
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)

    specs = [x.split(":") for x in args.configs.split(",") if x]

    def configs(D):
        if not specs:
            return [sm90_backward_config(D)]
        return [Sm90BwdConfig(block_m=int(bm)) for (d, bm) in specs if int(d) == D]
    global PAIR_COPIES
    PAIR_COPIES = args.pair_copies
    for path in filter(None, args.ab.split(",")):
        name = os.path.splitext(os.path.basename(path))[0]
        AB_BASE[name] = load_ab_base(path, name)
    ok = True
    if args.check:
        ok = check(args.seed, configs)
        print("CHECK", "PASS" if ok else "FAIL", flush=True)
    if args.time:
        time_workloads([x for x in args.workloads.split(",") if x], configs, args_det=args.det,
                       shapes=[x for x in args.shapes.split(",") if x],
                       fp8=args.fp8, rounds=args.rounds, both_modes=args.both_modes)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
