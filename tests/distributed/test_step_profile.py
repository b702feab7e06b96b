"""`Executor.start_profile` / `stop_profile` (device/step_profile.py): the steps between them
traced by the runner's process, at TP=1 the engine's own, at TP=2 rank 0's worker, into one
Chrome trace; nothing traced unless asked."""

from __future__ import annotations

import gzip
import json

import pytest

from pagedserve.entrypoints.llm import LLM
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams


def trace_ops(path) -> list[str]:
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "cpu_op"]


@pytest.mark.parametrize("tp", [1, 2])
def test_steps_between_start_and_stop_are_traced(llama, tmp_path, tp):
    llm = LLM.from_engine(LLMEngine.from_options(
        llama, device="cpu", dtype="float32", kv_cache_memory=4 << 20, seed=0,
        tensor_parallel_size=tp))
    executor = llm.llm_engine.engine_core.executor
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    try:
        executor.stop_profile(str(tmp_path / "never.json.gz"))  # no trace was started
        assert not (tmp_path / "never.json.gz").exists()
        executor.start_profile()
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        executor.stop_profile(str(tmp_path / "trace.json.gz"))
        assert len(out[0].outputs[0].token_ids) == 3
        ops = trace_ops(tmp_path / "trace.json.gz")
        assert "aten::embedding" in ops  # the forward passes ran under the profiler
        # the ranks' all-reduces were traced in rank 0's worker, and none at TP=1
        assert ("c10d::allreduce_" in ops) == (tp > 1)
        llm.generate([[5, 6, 7]], params, use_tqdm=False)  # untraced steps still run
    finally:
        llm.llm_engine.shutdown()
