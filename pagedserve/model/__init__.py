"""One decoder for every family in config.SUPPORTED_ARCHITECTURES (Llama, Mistral, Qwen2/3, Phi-3,
Gemma 2/3, Mixtral, Qwen3-MoE) and its loaders (HF safetensors folder or GGUF)."""

from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.model.loader import default_model_path, load_model, load_tokenizer

__all__ = ["Decoder", "ModelConfig", "default_model_path", "load_model", "load_tokenizer"]
