"""OutputProcessor: the frontend's output side, from engine-core token ids to RequestOutputs.

The core reports token ids per core request (one per sample); this module owns everything
that needs the tokenizer or the user's view of a request: the n samples of a parent request
(`<id>#<i>`), incremental detokenization, stop strings (a match finishes the sample here and
is returned as a core request to abort), logprobs with their token strings, and the
RequestOutput with cumulative and delta fields. No torch: it runs in the API process.

The token that stopped a sample (EOS or one of stop_token_ids) stays in its token ids but not
in its text, unless `include_stop_str_in_output` (vLLM's rule, the same as for stop strings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.frontend.outputs import (
    CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs)
from pagedserve.messages import (
    EngineCoreOutputs, EngineCoreRequest, LogprobsLists, TokenLogprobs)
from pagedserve.sampling_params import SamplingParams


@dataclass(eq=False)
class _Sample:
    """One core request: its tokens, text, logprobs and what was already reported."""

    request_id: str
    index: int
    parent: _Parent
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    detokenize_at_end: bool  # final-only and no stop strings: text decoded once
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # the core's reason for finishing it (EngineCoreOutput.error)
    num_reported_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    final_only: bool  # report only the finished output (offline generation)
    metrics: RequestMetrics
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when asked for, once the prompt is done

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._samples: dict[str, _Sample] = {}  # by core request id
        self.prompt_tokens_total = 0  # prompts of requests that produced a token, once per n
        self.generation_tokens_total = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, core_requests: list[EngineCoreRequest],
                    final_only: bool = False) -> None:
        """Track a parent request and its samples (the core requests the Processor made);
        raises ValueError if one of their ids is in use.

        `final_only`: report the request only once it has finished, and decode its text once
        at the end unless stop strings need it token by token; per-token output work is
        what limits a GPU step at large batch.
        """
        taken = [r.request_id for r in core_requests if r.request_id in self._samples]
        if request_id in self._parents or taken:
            raise ValueError(f"request id {request_id!r} is already in use"
                             + (f" (samples {taken})" if taken else ""))
        arrival = core_requests[0].arrival_time
        parent = _Parent(request_id, prompt, prompt_token_ids, final_only,
                         RequestMetrics(arrival_time=arrival))
        wants_logprobs = params.logprobs is not None
        for index, core_request in enumerate(core_requests):
            sample_params = core_request.sampling_params
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, sample_params.stop_strings,
                sample_params.include_stop_str_in_output, sample_params.skip_special_tokens,
                sample_params.spaces_between_special_tokens)
            parent.samples.append(_Sample(
                core_request.request_id, index, parent, detokenizer,
                [] if wants_logprobs else None, 0.0 if wants_logprobs else None,
                final_only and not sample_params.stop_strings))
        self._parents[request_id] = parent
        for sample in parent.samples:
            self._samples[sample.request_id] = sample

    def abort_request(self, request_id: str, now: float) -> tuple[RequestOutput | None, list[str]]:
        """Finish a parent at once: its final output ("abort" for unfinished samples), and
        the core requests to abort. (None, []) for an unknown id."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None, []
        running = [s.request_id for s in parent.samples if not s.finished]
        for sample in parent.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
        parent.metrics.finished_time = now
        output = self._make_output(parent)
        self._drop(parent)
        return output, running

    def process_outputs(self, outputs: EngineCoreOutputs
                        ) -> tuple[list[RequestOutput], list[str]]:
        """The RequestOutputs of the parents that progressed (final-only ones once finished),
        and the core requests that a stop string finished, which the core must abort."""
        to_abort: list[str] = []
        touched: dict[str, _Parent] = {}  # ordered: the parents to report
        now = outputs.timestamp
        samples = self._samples
        num_new = 0
        # per token per request at every step: kept to plain attribute reads
        for out in outputs.outputs:
            sample = samples.get(out.request_id)
            if sample is None or sample.finish_reason is not None:
                continue  # aborted, or finished by a stop string while its step was in flight
            new_ids = out.new_token_ids
            if not sample.token_ids:
                self._first_token(sample, out.num_cached_tokens, now)
            sample.token_ids.extend(new_ids)
            num_new += len(new_ids)
            if out.prompt_logprobs is not None and sample.index == 0:
                sample.parent.prompt_logprobs = self._prompt_logprobs(sample.parent,
                                                                      out.prompt_logprobs)
            if out.new_logprobs is not None and sample.logprobs is not None:
                self._append_logprobs(sample, new_ids, out.new_logprobs)
            text_ids = new_ids
            if out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                sample.error = out.error
                detokenizer = sample.detokenizer
                if out.finish_reason == "stop" and not detokenizer.include_stop_str_in_output:
                    text_ids = new_ids[:-1]  # EOS or a stop token id: not part of the text
            if not sample.detokenize_at_end:
                self._detokenize(sample, text_ids, to_abort, len(new_ids))
            elif sample.finish_reason is not None:
                sample.detokenizer.update_at_once(
                    sample.token_ids[:len(sample.token_ids) - len(new_ids) + len(text_ids)])
            # a final-only parent is looked at only when one of its samples finishes
            parent = sample.parent
            if not parent.final_only or sample.finish_reason is not None:
                touched[parent.request_id] = parent
        self.generation_tokens_total += num_new
        request_outputs = []
        for parent in touched.values():
            finished = parent.finished
            if parent.final_only and not finished:
                continue
            if finished:
                parent.metrics.finished_time = now
            request_outputs.append(self._make_output(parent))
            if finished:
                self._drop(parent)
        return request_outputs, to_abort

    def _first_token(self, sample: _Sample, num_cached_tokens: int, now: float) -> None:
        parent = sample.parent
        if parent.metrics.first_token_time is None:
            parent.metrics.first_token_time = now
        if sample.index == 0:  # a prompt counts once, however many samples share it
            self.prompt_tokens_total += len(parent.prompt_token_ids)
            parent.metrics.num_cached_tokens = num_cached_tokens

    @staticmethod
    def _detokenize(sample: _Sample, new_ids: list[int], to_abort: list[str],
                    num_new: int = 1) -> None:
        """`num_new`: the tokens the sample received this step (`new_ids` may leave out
        its last, a stop token). Several at once (speculative decoding) go in one by one,
        so a stop string ends the sample's token ids where it completed, as it would have
        one token a step."""
        detokenizer = sample.detokenizer
        if len(new_ids) <= 1:
            stop, end = detokenizer.update(new_ids), None
        else:
            first = len(sample.token_ids) - num_new
            for i, token in enumerate(new_ids):
                stop, end = detokenizer.update([token]), first + i + 1
                if stop is not None:
                    break
        if stop is None:
            return
        if end is not None and end < len(sample.token_ids):  # before the step's last token
            if sample.logprobs is not None:  # the dropped tokens' logprobs go with them
                for token, entry in zip(sample.token_ids[end:], sample.logprobs[end:]):
                    sample.cumulative_logprob -= entry[token].logprob
                del sample.logprobs[end:]
            del sample.token_ids[end:]
            sample.finish_reason, sample.stop_reason = "stop", stop
            to_abort.append(sample.request_id)  # ignored by the core if it finished there
        elif not sample.finished:
            sample.finish_reason, sample.stop_reason = "stop", stop
            to_abort.append(sample.request_id)

    def _append_logprobs(self, sample: _Sample, new_ids: list[int],
                         new_logprobs: list[TokenLogprobs]) -> None:
        decode = self.tokenizer.decode
        for token, lp in zip(new_ids, new_logprobs):
            entry = {t: Logprob(v, rank + 1, decode([t]))
                     for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
            entry.setdefault(token, Logprob(lp.sampled_logprob, lp.sampled_rank,
                                            decode([token])))
            sample.logprobs.append(entry)
            sample.cumulative_logprob += lp.sampled_logprob

    def _prompt_logprobs(self, parent: _Parent, lists: LogprobsLists) -> PromptLogprobs:
        """vLLM's shape: None for the first prompt token (nothing predicts it), then per
        position the prompt token's own entry and the top ones."""
        decode = self.tokenizer.decode
        entries: PromptLogprobs = [None]
        for token, top_ids, top_lps, lp, rank in zip(
                parent.prompt_token_ids[1:], lists.top_token_ids, lists.top_logprobs,
                lists.sampled_logprobs, lists.sampled_ranks):
            entry = {t: Logprob(v, r + 1, decode([t]))
                     for r, (t, v) in enumerate(zip(top_ids, top_lps))}
            entry.setdefault(token, Logprob(lp, rank, decode([token])))
            entries.append(entry)
        return entries

    def _make_output(self, parent: _Parent) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[self._completion(s) for s in parent.samples], finished=parent.finished,
            metrics=parent.metrics, num_cached_tokens=parent.metrics.num_cached_tokens,
            prompt_logprobs=parent.prompt_logprobs)

    @staticmethod
    def _completion(sample: _Sample) -> CompletionOutput:
        """The sample's output so far. Its lists are handed over as they are once it has
        finished (nothing appends to them after), copied before (the caller may keep an output
        while the sample grows); the delta is a slice from the last report's offset."""
        finished = sample.finished
        token_ids = sample.token_ids if finished else list(sample.token_ids)
        delta_ids = sample.token_ids[sample.num_reported_tokens:]
        sample.num_reported_tokens = len(token_ids)
        logprobs = sample.logprobs
        if logprobs is not None and not finished:
            logprobs = list(logprobs)
        return CompletionOutput(
            index=sample.index, text=sample.detokenizer.output_text, token_ids=token_ids,
            cumulative_logprob=sample.cumulative_logprob, logprobs=logprobs,
            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
            text_delta=sample.detokenizer.take_delta(finished),
            token_ids_delta=delta_ids, error=sample.error)

    def _drop(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for sample in parent.samples:
            self._samples.pop(sample.request_id, None)
