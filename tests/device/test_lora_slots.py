"""The runner's LoRA rows per step (`LoRASlots.batch`): a step whose rows are all the base
model's gets no `LoRABatch`, eager or under a graph, so it launches no LoRA kernel (the runner
replays the decode graph captured without them); a step with one adapter row gets every row's
slot, padding rows the base model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.make_checkpoint import make_checkpoint
from pagedserve.device.lora_slots import LoRASlots
from pagedserve.model.loader import load_model
from pagedserve.model.ops import triton_ops

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama3.json"


def test_only_steps_with_an_adapter_row_run_lora(tmp_path):
    config = json.loads(CONFIG.read_text())
    config.update(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    make_checkpoint(tmp_path / "config.json", tmp_path / "base", torch.float32, seed=0,
                    tokenizer="bytes")
    model, config, _ = load_model(tmp_path / "base", torch.float32, "cpu", ops=triton_ops())
    slots = LoRASlots(model, config, 2, 8, 2, torch.device("cpu"))
    slots.allocate(16)
    decodes = np.ones(3, dtype=np.int64)
    for graph, rows in ((False, 3), (True, 4)):  # eager, and a graph of 4 rows
        assert slots.batch(np.full(3, -1, dtype=np.int32), decodes, rows, graph) is None
        batch = slots.batch(np.array([-1, 1, -1], dtype=np.int32), decodes, rows, graph)
        assert batch.token_slots.tolist() == [-1, 1, -1, -1][:rows]
        assert slots.batch(np.full(3, -1, dtype=np.int32), decodes, rows, graph) is None
