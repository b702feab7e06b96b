"""Host time of the runner's `prepare_inputs` per decode step, on the CPU.

A tiny random Qwen3 (the structured tests' shape) with a long max_model_len, so each
block-table row is wide (max_model_len / block_size columns), and many sequences decoding:
the work a GPU engine's host does before every step, without a GPU.

    python benchmarks/prepare_inputs.py [--seqs 256] [--max-model-len 40960] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.make_checkpoint import make_checkpoint  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.frontend.llm_engine import LLMEngine, LoadedModel  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "vocab_size": 259,
    "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.5,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=40960)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(
        dict(CONFIG, max_position_embeddings=args.max_model_len)))
    make_checkpoint(root / "config.json", root / "ckpt", torch.float32, seed=0,
                    tokenizer="bytes")
    loaded = LoadedModel.load(EngineConfig(model=str(root / "ckpt"), device="cpu",
                                           dtype="float32"))
    block_bytes = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 layers, 16 tokens, 2 heads of 32, fp32
    engine = LLMEngine(EngineConfig(
        model="tiny", device="cpu", dtype="float32", block_size=16, max_num_seqs=args.seqs,
        max_num_batched_tokens=8192, kv_cache_memory=block_bytes * 8192,
        enable_prefix_caching=False), loaded)
    runner = engine.engine_core.model_runner
    spent, inner = [0.0], runner.prepare_inputs

    def timed(output):
        start = time.perf_counter()
        try:
            return inner(output)
        finally:
            spent[0] += time.perf_counter() - start

    runner.prepare_inputs = timed
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", None, params,
                           prompt_token_ids=[3 + (i * 7 + j) % 250 for j in range(20)])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    print(f"{steps} steps, {args.seqs} sequences, max_model_len {engine.max_model_len} "
          f"({runner.buffers.block_tables.np.shape[1]} block-table columns): prepare_inputs "
          f"{spent[0] / steps * 1e3:.3f} ms a step")


if __name__ == "__main__":
    main()
