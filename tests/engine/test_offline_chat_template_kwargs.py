"""LLM.chat's chat_template_kwargs reach the template, on the tiny Qwen3 of
test_reasoning_api.py (its template closes an empty think block when `enable_thinking` is
false): the submitted prompt changes exactly so; apply_chat_template's own arguments are
refused."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.llm import LLM
from pagedserve.frontend.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams
from tests.server.test_reasoning_api import ASK, checkpoint  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLMEngine.from_options(model=str(checkpoint), load_format="dummy", device="cpu",
                                    dtype="float32", kv_cache_memory=16 << 20)
    yield LLM.from_engine(engine)
    engine.shutdown()


def test_chat_template_kwargs_reach_the_template(llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    thinking, = llm.chat(ASK, params, use_tqdm=False)
    plain, = llm.chat(ASK, params, use_tqdm=False,
                      chat_template_kwargs={"enable_thinking": False})
    assert plain.prompt_token_ids[:len(thinking.prompt_token_ids)] == thinking.prompt_token_ids
    tail = plain.prompt_token_ids[len(thinking.prompt_token_ids):]
    assert llm.get_tokenizer().decode(tail) == "<think>\n\n</think>\n\n"
    assert llm.apply_chat_template(ASK, chat_template_kwargs={"enable_thinking": False}) \
        == plain.prompt_token_ids


def test_the_templates_own_arguments_are_refused(llm):
    with pytest.raises(ValueError, match="tokenize"):
        llm.chat(ASK, use_tqdm=False, chat_template_kwargs={"tokenize": True})
