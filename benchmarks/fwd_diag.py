"""Localize a GPU-only forward failure: quantize stage vs reference, then forward variants.

    python3 benchmarks/fwd_diag.py
"""
import torch

from flamia import reference as R
from flamia.inputs import make_qkv, rel_err
from flamia.ops.forward import FwdConfig, attention_forward, default_config
from flamia.ops.quantize import quantize_qkv
from flamia.recipes import get_recipe


def nan8(x):
    return torch.isnan(x.float()).sum().item()


def main():
    dev = "cuda"
    lengths = [700, 0, 1, 333, 1024]
    for D in (128, 64):
        q, k, v, cu = make_qkv(lengths, 8, 2, D, "mild", device=dev, seed=3)
        rec = get_recipe("fp8")
        qkv = quantize_qkv(q, k, v, cu, rec, True, poison=True)
        ref_out, ref_lse, saved = R.forward(q, k, v, cu, rec)
        print(f"D={D} nan q8 {nan8(qkv.q8)} k8 {nan8(qkv.k8)} v8 {nan8(qkv.v8)} vt8 {nan8(qkv.vt8)}")
        for name, got, op in (("q", qkv.q8, saved.q), ("k", qkv.k8, saved.k), ("v", qkv.v8, saved.v)):
            mism = (got.float() != op.values).float().mean().item()
            s_got = {"q": qkv.sq, "k": qkv.sk, "v": qkv.sv}[name]
            smism = (s_got.T != op.scale[..., 0]).float().mean().item()
            print(f"  {name}8 value mismatch frac {mism:.2e}  scale mismatch frac {smism:.2e}")
        T = q.shape[0]
        vt_ok = (qkv.vt8[:, :, :T].permute(2, 0, 1).float() == qkv.v8.float()).float().mean().item()
        print(f"  vt8 == v8^T frac {vt_ok:.6f}")
        cap_ref = R._v_cap(saved.v.token_scale().T, True)
        base = default_config(D, True, q.device)
        for tma in (True, False):
            for vk in (True, False):
                cfg = base.with_(use_tma=tma, v_kmajor=vk)
                try:
                    out, lse = attention_forward(qkv, cu, max(lengths), True, None, torch.bfloat16,
                                                 config=cfg, poison=True)
                    torch.cuda.synchronize()
                    print(f"  fwd tma={tma} vkmajor={vk}: nan {torch.isnan(out).sum().item()} "
                          f"rel {rel_err(out.float(), ref_out):.3e} lse maxdiff "
                          f"{(lse - ref_lse).abs().nan_to_num(99).max().item():.3e}")
                except Exception as e:  # noqa: BLE001
                    print(f"  fwd tma={tma} vkmajor={vk}: ERROR {type(e).__name__}: {str(e)[:200]}")
        # cast probe: does the GPU's fp32->e4m3 conversion round like torch?
        import triton
        import triton.language as tl

        @triton.jit
        def _cast(X, Y, N: tl.constexpr):
            o = tl.arange(0, N)
            tl.store(Y + o, tl.load(X + o).to(tl.float8e4nv))
        x = torch.randn(4096, device=dev) * 100
        x[:4] = torch.tensor([500.0, 448.0, 1e-4, 465.0])
        y = torch.empty(4096, dtype=torch.float8_e4m3fn, device=dev)
        _cast[(1,)](x, y, N=4096)
        ref = x.clamp(-448, 448).to(torch.float8_e4m3fn)
        print(f"  cast probe: mismatch {(y.float() != ref.float()).sum().item()} / 4096, first {y[:4].float().tolist()}")
        print(f"  cap mismatch frac {(qkv.vcap != cap_ref).float().mean().item():.2e}")


if __name__ == "__main__":
    main()
