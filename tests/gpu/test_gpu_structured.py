"""Structured outputs on CUDA: the grammar process (the default there) against the grammar
on threads of the engine's process, on the same random Qwen3-0.6B-shaped checkpoint.

Grammars compile in the background, so which step a constrained request joins depends on
when its compile finishes, and a batch's makeup moves the bf16 sums (and a random model's
near-ties) of everyone in it. So the two engines are compared token for token with one
request at a time, where nothing depends on timing; the batched run checks every constrained
output against its constraint (a bitmask row given to the wrong request breaks one); and
the shared buffers the child fills are page-locked, so the bitmask's upload is a plain
async copy."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.gpu.test_gpu_engine import make_engine, prompts
from tests.structured.test_engine import PERSON
from tests.structured.test_remote import grammar_child

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def requests():
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured.params import StructuredOutputsParams

    specs = [StructuredOutputsParams(json=PERSON), None,
             StructuredOutputsParams(regex=r"[a-z]{2,4}-[0-9]{2}"),
             StructuredOutputsParams(choice=["alpha", "beta", "gamma"])]
    return [(ids, SamplingParams(max_tokens=120, temperature=0.0 if i % 2 else 0.8, seed=i,
                                 structured_outputs=specs[i % 4]))
            for i, ids in enumerate(prompts(32, seed=11))]


def run(engine, batch):
    for i, (ids, params) in enumerate(batch):
        engine.add_request(f"s{i}", None, params, prompt_token_ids=ids)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
    assert not engine.kv_cache_manager.req_to_blocks
    return [done[f"s{i}"] for i in range(len(batch))]


@torch.inference_mode()
def test_grammar_process_gives_the_in_process_tokens(loaded):
    from pagedserve.structured.remote import GrammarProcess

    batch = requests()
    alone = batch[:8]
    expected = run(make_engine(loaded, grammar_process=False, max_num_seqs=1), alone)
    one_at_a_time = make_engine(loaded, max_num_seqs=1)
    got = run(one_at_a_time, alone)
    one_at_a_time.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    engine = make_engine(loaded)
    assert isinstance(engine.structured, GrammarProcess)
    got = run(engine, batch)
    child = grammar_child()
    for output, (_, params) in zip(got, batch):
        spec = params.structured_outputs
        if spec is None:
            continue
        assert output.finish_reason == "stop", output.text
        if spec.json is not None:
            jsonschema.validate(json.loads(output.text), PERSON)
        elif spec.regex is not None:
            assert re.fullmatch(spec.regex, output.text)
        else:
            assert output.text in spec.choice
    engine.shutdown()
    child.wait(timeout=30)
    assert not child.is_running()
