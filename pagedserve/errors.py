"""RequestError: a request the engine refuses, naming the field at fault.

SamplingParams and the Processor are the one place a request is checked against the model
(lengths, vocabulary, the structured-output spec); the API server does not repeat those
checks, it maps `param` to the name the client sent and answers 400 with the message.
"""

from __future__ import annotations


class RequestError(ValueError):
    """`param`: a SamplingParams field, or "prompt"; None when no single field is at fault.
    `code`: a machine-readable reason (OpenAI's `context_length_exceeded`), or None.

    A message may name its field as `{param}`; `str()` shows the engine's name and
    `message_for` the name a caller used (the server's `max_completion_tokens`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        self.template, self.param, self.code = message, param, code
        super().__init__(self.message_for(param))

    def message_for(self, name: str | None) -> str:
        return self.template.replace("{param}", name or "the request")
