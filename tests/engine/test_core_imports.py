"""The engine core starts and serves without importing transformers (its import took most of
the core's start-up): config.json and the tokenizer's size and EOS id are read without it.
Checked in a fresh interpreter that builds the core as the core process does and runs a
request to its end."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.tensor_parallel import model_folder

SCRIPT = """
import json, sys, time
from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineCore
from pagedserve.messages import EngineCoreRequest
from pagedserve.sampling_params import SamplingParams

core = EngineCore(EngineConfig(model=sys.argv[1], load_format="dummy", device="cpu",
                               max_model_len=256, kv_cache_memory=16 << 20))
core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(temperature=0.0,
                 max_tokens=4, ignore_eos=True), time.time()))
tokens, reason = [], None
while core.has_unfinished_requests():
    for out in core.step().outputs:
        tokens += out.new_token_ids
        reason = out.finish_reason or reason
core.shutdown()
print(json.dumps({"tokens": len(tokens), "finish": reason,
                  "eos": sorted(core.eos_token_ids),
                  "transformers": "transformers" in sys.modules}))
"""


def test_an_hf_folder_core_serves_without_transformers(tmp_path):
    folder = model_folder(tmp_path, "tiny-qwen3")  # byte-level tokenizer, EOS <|im_end|>
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tokens": 4, "finish": "length", "eos": [2],
                      "transformers": False}
