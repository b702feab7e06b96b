"""One decoder for Llama / Qwen2 / Qwen3 and its loaders (HF safetensors folder or GGUF)."""

from pagedserve.model.config import ModelConfig
from pagedserve.model.decoder import Decoder
from pagedserve.model.loader import default_model_path, load_model, load_tokenizer

__all__ = ["Decoder", "ModelConfig", "default_model_path", "load_model", "load_tokenizer"]
