"""The detokenizer's direct decode gives transformers' text, and streaming token by token
builds the same text as decoding the whole output at once."""

from __future__ import annotations

import random

import pytest

from pagedserve.frontend.detokenizer import IncrementalDetokenizer, decode_function
from pagedserve.model.loader import default_model_path, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _random_ids(rng: random.Random, tokenizer, length: int) -> list[int]:
    """Ordinary tokens mixed with special ones (the first ids) and single bytes."""
    special = list(tokenizer.all_special_ids)
    return [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
            for _ in range(length)]


@pytest.mark.parametrize("seed", range(4))
def test_decode_function_equals_tokenizer_decode(tokenizer, seed):
    rng = random.Random(seed)
    decode = decode_function(tokenizer)
    for length in (0, 1, 2, 7, 40):
        ids = _random_ids(rng, tokenizer, length)
        for skip in (True, False):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_equals_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    prompt = tokenizer.encode("Tell me about caf\u00e9s in \u6771\u4eac")
    output = tokenizer.encode(" Caf\u00e9s \U0001f600 in \u6771\u4eac are") + _random_ids(
        rng, tokenizer, 30) + tokenizer.encode(" fine.")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    for token_id in output:
        assert detokenizer.update([token_id]) is None
    context = prompt[-5:]
    whole = tokenizer.decode(context + output, skip_special_tokens=True)
    assert detokenizer.output_text == whole[len(tokenizer.decode(context,
                                                                 skip_special_tokens=True)):]


def test_a_streamed_output_keeps_its_tokens_while_the_request_grows(tokenizer):
    """OutputProcessor's outputs: each streamed output's cumulative token ids stay what they
    were when it was made (the sample's list keeps growing after), deltas follow the reported
    offset, and the finished output holds every token."""
    from pagedserve.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
    from pagedserve.frontend.output_processor import OutputProcessor
    from pagedserve.sampling_params import SamplingParams

    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hello")
    params = SamplingParams(max_tokens=8)
    processor.add_request("r", "Hello", prompt, params,
                          [EngineCoreRequest("r", prompt, params, 0.0)])
    words = [tokenizer.encode(w) for w in (" one", " two", " three")]
    seen = []
    for i, ids in enumerate(words):
        last = i == len(words) - 1
        outputs, _ = processor.process_outputs(EngineCoreOutputs(
            [EngineCoreOutput("r", ids, finish_reason="length" if last else None)]))
        (output,) = outputs
        seen.append(output.outputs[0])
    flat = [t for ids in words for t in ids]
    assert [c.token_ids for c in seen] == [flat[:len(words[0])],
                                          flat[:len(words[0]) + len(words[1])], flat]
    assert [c.token_ids_delta for c in seen] == words
    assert seen[-1].text == " one two three" and not processor.has_unfinished_requests()


@pytest.mark.parametrize("finish", [None, "stop"])
def test_a_stop_string_inside_several_new_tokens_ends_the_token_ids_there(tokenizer, finish):
    """Speculative decoding hands over several tokens at once: a stop string completed by
    one of them ends the sample's token ids at that token, as one token a step would (the
    core is asked to abort), whatever the core said of the step's last token; the logprobs
    of the tokens after it go with them."""
    from pagedserve.messages import (
        EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, TokenLogprobs)
    from pagedserve.frontend.output_processor import OutputProcessor
    from pagedserve.sampling_params import SamplingParams

    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Count")
    params = SamplingParams(max_tokens=20, stop=[" two"], logprobs=0)
    processor.add_request("r", "Count", prompt, params,
                          [EngineCoreRequest("r", prompt, params, 0.0)])
    one, two, three = (tokenizer.encode(w) for w in (" one", " two", " three"))
    new = one + two + three + ([tokenizer.eos_token_id] if finish else [])
    logprobs = [TokenLogprobs([], [], -0.5 * (i + 1), 1) for i in range(len(new))]
    outputs, to_abort = processor.process_outputs(EngineCoreOutputs(
        [EngineCoreOutput("r", new, logprobs, finish_reason=finish)]))
    (output,) = outputs
    assert output.outputs[0].token_ids == one + two
    kept = len(one + two)
    assert len(output.outputs[0].logprobs) == kept
    assert [entry[t].logprob for t, entry in zip(one + two, output.outputs[0].logprobs)] \
        == [lp.sampled_logprob for lp in logprobs[:kept]]
    assert output.outputs[0].cumulative_logprob == pytest.approx(
        sum(lp.sampled_logprob for lp in logprobs[:kept]))
    assert output.outputs[0].text == " one" and output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].stop_reason == " two" and to_abort == ["r"]
