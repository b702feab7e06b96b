"""A request's tokens as one list: the prompt, then each token sampled after it, the output
tokens a view at the prompt's length rather than a second list. The scheduler's `Request`
(engine/request.py) and the runner's `CachedRequestState` (device/input_batch.py) both keep
them this way, in different processes, so the type sits below both."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice


class OutputTokenIds(Sequence[int]):
    """The tokens after the prompt, read in place from the sequence's one token list."""

    __slots__ = ("_tokens", "_start")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens, self._start = tokens, start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step > 0:
                return self._tokens[self._start + start:self._start + stop:step]
            return self._tokens[self._start:][index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("output token index out of range")
        return self._tokens[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return islice(self._tokens, self._start, None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return repr(self._tokens[self._start:])


class TokenSequence:
    """A prompt and the tokens sampled after it, in one list (`all_token_ids`); the output
    tokens are a view of it (`output_token_ids`). Mixed into `Request` and the runner's
    `CachedRequestState`, whose `__post_init__` calls `_init_tokens`."""

    prompt_token_ids: list[int]

    def _init_tokens(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> OutputTokenIds:
        return OutputTokenIds(self.all_token_ids, self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
