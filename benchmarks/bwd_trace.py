"""Timeline of the bf16 backward kernel's work items under three deals, one process: where the
persistent kernel's time goes that the static snake deal saves and the counter's deal does not
(benchmarks/NOTES.md, fourteenth session).

    python benchmarks/bwd_trace.py [--workloads doc512_x64,doc2k_x16] [--out DIR]
    python benchmarks/bwd_trace.py --compile        # CPU: sm_90a builds of the traced kernel

The kernel is benchmarks/trace_backward_sm90.py, a copy of the persistent backward module
(branch exp/bwd-persistent-2) whose compute warps write %globaltimer at each item's start and end,
and its loader at each deal, per work-list column (TRACE_BUF). Deals (TRACE_MODE): "main" (one
CTA per column, the hardware deals them), "dynamic" (one CTA per SM, an atomic counter),
"snake" (one CTA per SM, static snake rounds). Per deal and workload it prints the untraced median
(paired against "main"), the makespan, a least-squares fit of item time = a + b * steps, the mean
gap between a CTA's (or an SM's) consecutive items, the load wait (deal to start), and saves the
records as DIR/trace-WORKLOAD-DEAL.pt.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEALS = ("main", "dynamic", "snake")


def load_traced():
    spec = importlib.util.spec_from_file_location("flamia.ops.trace_backward_sm90",
                                                  os.path.join(HERE, "trace_backward_sm90.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def compile_check():
    from benchmarks.tools.compile import compile_only, resource_usage
    T, Hq, Hkv = 1024, 8, 2
    cu = torch.tensor([0, 300, T], dtype=torch.int32)
    for D in (128, 64):
        q, do, o = (torch.randn(T, Hq, D).to(torch.bfloat16) for _ in range(3))
        k, v = (torch.randn(T, Hkv, D).to(torch.bfloat16) for _ in range(2))
        for deal in DEALS:
            for traced in (False, True):
                M = load_traced()
                M.TRACE_MODE = deal
                M.TRACE_BUF = torch.zeros(4096, 8, dtype=torch.int32) if traced else None
                with compile_only() as built:
                    M.attention_backward_sm90(do, o, torch.zeros(Hq, T), q, k, v, cu, True, None)
                for name, kern in built:
                    if "bwd_sm90_kernel" in name:
                        u = resource_usage(kern)
                        print(f"D={D} {deal} traced={traced}: regs={u['regs']} "
                              f"spills={u['spill_stores']} smem={u['shared']}")


def steps_of(items, BM, BN, group, causal=True):
    """Steps (GROUP x query blocks) of every work-list column; 0 for padding."""
    doc, blk, L = items[0].long(), items[1].long(), items[3].long()
    nq = (L + BM - 1) // BM
    n_m = nq - (blk * BN) // BM if causal else nq
    return torch.where(doc >= 0, group * n_m, torch.zeros_like(n_m))


def analyse(rec, steps):
    """Summary of one traced call: rec (n_items, 8) int32 records, steps per column."""
    ok = (steps > 0) & (rec[:, 0] != -1) & (rec[:, 1] != -1)
    r = rec[ok].long()
    st = steps[ok].double()
    t0 = r[:, 0].min()
    start = ((r[:, 0] - t0) % (1 << 32)).double() / 1e3     # us
    end = ((r[:, 1] - t0) % (1 << 32)).double() / 1e3
    deal = ((r[:, 3] - t0) % (1 << 32)).double() / 1e3
    dur = end - start
    A = torch.stack([torch.ones_like(st), st], 1)
    coef = torch.linalg.lstsq(A, dur.unsqueeze(1)).solution.squeeze(1)
    sm, pid, j = r[:, 4], r[:, 5], r[:, 6]
    # gaps between consecutive items on one SM (one CTA per SM at a time in every deal)
    gaps = []
    tails = []
    makespan = end.max().item()
    for s in sm.unique():
        idx = (sm == s).nonzero().squeeze(1)
        order = idx[start[idx].argsort()]
        gs = start[order][1:] - end[order][:-1]
        gaps += gs.tolist()
        tails.append(makespan - end[order][-1].item())
    load_wait = (start - deal)
    by_steps = {}
    for s in st.unique().tolist():
        m = st == s
        by_steps[int(s)] = (int(m.sum()), round(dur[m].median().item(), 2))
    return {
        "items": int(ok.sum()), "makespan_us": round(makespan, 1),
        "fit_a_us": round(coef[0].item(), 2), "fit_b_us_per_step": round(coef[1].item(), 3),
        "busy_us_per_sm": round(dur.sum().item() / len(sm.unique()), 1),
        "gap_mean_us": round(statistics.fmean(gaps), 2) if gaps else None,
        "gap_median_us": round(statistics.median(gaps), 2) if gaps else None,
        "tail_mean_us": round(statistics.fmean(tails), 1),
        "load_wait_median_us": round(load_wait.median().item(), 2),
        "median_us_by_steps": by_steps,
    }


def run(workloads, out_dir, rounds=5, reps=20):
    from flamia.inputs import cu_seqlens_from_lengths
    import flamia
    M = load_traced()
    wl = json.load(open(os.path.join(HERE, "..", "flamia", "data", "workloads.json")))["workloads"]
    print(torch.__version__, torch.cuda.get_device_name())
    for w in wl:
        if w["name"] not in workloads:
            continue
        lengths, Hq, Hkv, D = w["doc_lengths"], w["heads_q"], w["heads_kv"], w["head_dim"]
        T = sum(lengths)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, h, D, device="cuda", generator=g).to(torch.bfloat16)
                       for h in (Hq, Hkv, Hkv, Hq))
        cu = cu_seqlens_from_lengths(lengths, device="cuda")
        mx = max(lengths)
        o, lse = flamia.flamia_attn_varlen_func(q, k, v, cu, cu, mx, mx, recipe="bf16",
                                                return_lse=True, check_finite=False)
        cfg = M.sm90_backward_config(D)
        BM, BN = cfg.block_m, M.SM90_BLOCK_N
        kb = M.key_blocks(cu, T, BM, BN, True, Hkv)
        steps = steps_of(kb.items.cpu(), BM, BN, Hq // Hkv)

        def call(deal, buf=None):
            M.TRACE_MODE, M.TRACE_BUF = deal, buf
            return M.attention_backward_sm90(do, o, lse, q, k, v, cu, True, D ** -0.5)

        want = call("main")
        for deal in DEALS:     # builds, and the same gradients from every deal
            got = call(deal)
            same = [torch.equal(a, b) for a, b in zip(want[1:], got[1:])]
            dq_ok = torch.allclose(want[0].float(), got[0].float(), rtol=1e-2, atol=1e-3)
            print(f"{w['name']} {deal}: dk / dv bitwise main's {same}, dq close {dq_ok}")
        # untraced medians, deals interleaved, order reversed every other round
        ms = {d: [] for d in DEALS}
        for r in range(rounds):
            for deal in (DEALS if r % 2 == 0 else DEALS[::-1]):
                for _ in range(3):
                    call(deal)
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(reps)]
                for a, b in ev:
                    a.record()
                    call(deal)
                    b.record()
                torch.cuda.synchronize()
                ms[deal].append(statistics.median(a.elapsed_time(b) for a, b in ev))
        summary = {"workload": w["name"], "device": torch.cuda.get_device_name()}
        for deal in DEALS:
            paired = statistics.median(x / y for x, y in zip(ms[deal], ms["main"]))
            buf = torch.full((kb.n_items, 8), -1, dtype=torch.int32, device="cuda")
            for _ in range(3):      # the last of three traced calls
                buf.fill_(-1)
                call(deal, buf)
            torch.cuda.synchronize()
            rec = buf.cpu()
            torch.save({"rec": rec, "items": kb.items.cpu(), "steps": steps},
                       os.path.join(out_dir, f"trace-{w['name']}-{deal}.pt"))
            a = analyse(rec, steps)
            a.update({"ms": round(statistics.median(ms[deal]), 4), "paired_vs_main": round(paired, 4)})
            summary[deal] = a
            print(json.dumps({"workload": w["name"], "deal": deal, **a}))
        with open(os.path.join(out_dir, f"trace-summary-{w['name']}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    M.TRACE_MODE, M.TRACE_BUF = "main", None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="doc512_x64,doc2k_x16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.compile:
        compile_check()
    else:
        run(a.workloads.split(","), a.out, a.rounds)


if __name__ == "__main__":
    main()
