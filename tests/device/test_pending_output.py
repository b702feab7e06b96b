"""A step's output read before `result()` (what a tensor-parallel rank 0 sends the engine
early, `worker.py`): the same output, with nothing placed until `result()` runs."""

from __future__ import annotations

from pagedserve.sampling_params import SamplingParams
from tests.engine.test_async_scheduling import loaded, make  # noqa: F401 (fixture)


def test_an_output_read_early_is_the_result_and_places_no_token(loaded):  # noqa: F811
    engine = make(loaded, async_scheduling=False)
    core, runner = engine.engine_core, engine.engine_core.model_runner
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4, logprobs=2)
    engine.add_request("r", None, params, prompt_token_ids=[5, 6, 7, 8])
    out = core.scheduler.schedule()
    pending = runner.sample_tokens(runner.launch(runner.prepare_step(out)))
    state = runner.requests["r"]
    before = list(state.output_token_ids)
    early = pending.output_if_ready()
    assert early is not None and early.req_ids == ["r"] and early.logprobs is not None
    assert state.output_token_ids == before  # nothing placed
    result = pending.result()
    assert result == early
    assert state.output_token_ids == [*before, result.sampled_token_ids[0]]
    core.scheduler.update_from_output(out, result)
    engine.abort_request(["r"])
    while engine.has_unfinished_requests():
        engine.step()
