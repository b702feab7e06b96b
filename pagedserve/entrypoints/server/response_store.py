"""ResponseStore: the Responses API's stored responses, in memory and bounded.

What `previous_response_id`, retrieve and delete read. Each entry keeps the response object
(what GET returns) and the conversation that produced it, as chat messages (the input and
earlier turns, without the instructions, which OpenAI does not carry over), so continuing a
response is one lookup, never a walk along a chain. The store is bounded both in entries and
in the size of what it holds (a conversation can be as large as a request body); past
either bound the oldest entries go first. An evicted or unstored response is simply not
found (404), as one from another server would be. Nothing is written to disk: a restart
forgets every response.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    conversation: list[dict[str, Any]]  # chat messages: the input, then the output
    size: int  # bytes of both as JSON: what counts against the store's bound


class ResponseStore:
    """Stored responses by id; insertion order is eviction order."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) \
            + len(json.dumps(conversation, ensure_ascii=False))
        self.delete(response["id"])
        if self.max_entries == 0 or size > self.max_bytes:
            return  # never kept: it would evict everything and still not fit
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= oldest.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
