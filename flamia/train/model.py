"""The model of `flamia train-check`: a stock transformers LlamaForCausalLM (RMSNorm, RoPE, SwiGLU,
GQA) whose attention runs through flamia via the HF integration (flamia/integrations/hf.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .data import N_TOKENS


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int = 320          # 258 byte-level tokens, padded to a multiple of 64

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # ~23M parameters: the GPU check
    "small": ModelSize(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, intermediate=1408),
    # the CPU smoke test
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=128),
}


def build_model(size: ModelSize, max_positions: int, seed: int, device, attn_implementation: str):
    """A freshly initialised LlamaForCausalLM; the init depends only on `seed` (made on the CPU,
    then moved), so runs with the same seed start from the same weights on any device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size.vocab < N_TOKENS:
        raise ValueError(f"vocab {size.vocab} < {N_TOKENS} byte-level tokens")
    config = LlamaConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads, head_dim=size.head_dim,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, attention_dropout=0.0,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, initializer_range=0.02,
        use_cache=False, bos_token_id=256, eos_token_id=257, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    set_attention(model, attn_implementation)
    return model.to(device)


def set_attention(model, name: str) -> None:
    """Switch the attention implementation of a built model (all layers read it at each call)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batch_to_device(batch, device) -> dict:
    """Tensors of a data.Batch for the model call (flattened batch of one row)."""
    return {
        "input_ids": torch.from_numpy(batch.tokens).to(device, non_blocking=True)[None],
        "targets": torch.from_numpy(batch.targets).to(device, non_blocking=True),
        "position_ids": torch.from_numpy(batch.position_ids).to(device, non_blocking=True)[None],
        "cu_seqlens": torch.from_numpy(batch.cu_seqlens).to(device, non_blocking=True),
        "max_seqlen": int(batch.max_seqlen),
        "n_targets": int(batch.n_targets),
    }


def loss_sum(model, b: dict, amp: bool) -> torch.Tensor:
    """Sum of next-token cross-entropies (fp32) over the batch's targets.

    Documents are passed to attention as explicit varlen kwargs (host-known lengths: no sync to
    derive them); position_ids restart per document for RoPE.
    """
    device_type = b["input_ids"].device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
        out = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                    cu_seq_lens_q=b["cu_seqlens"], cu_seq_lens_k=b["cu_seqlens"],
                    max_length_q=b["max_seqlen"], max_length_k=b["max_seqlen"], use_cache=False)
    logits = out.logits[0].float()
    return torch.nn.functional.cross_entropy(logits, b["targets"], ignore_index=-100, reduction="sum")
