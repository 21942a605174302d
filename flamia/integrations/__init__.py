"""Integrations of flamia attention into other libraries.

- `flamia.integrations.hf`: Hugging Face transformers (`AttentionInterface`): register flamia as an
  `attn_implementation` ("flamia_fp8", ...) so a stock model (LlamaForCausalLM, ...) trains with it,
  packed documents included.

Submodules import their library lazily; importing this package imports nothing optional.
"""

__all__ = ["hf"]
