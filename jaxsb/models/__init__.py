"""LLaMA-family model, its loss, and pretrained-weight loading.

Importing this package imports JAX and Flax; `jaxsb.models.pretrained` is not imported here
(it pulls in gguf / safetensors / tokenizers), import it explicitly.
"""

from jaxsb.models.llama import Llama
from jaxsb.models.loss import next_token_loss

__all__ = ["Llama", "next_token_loss"]
