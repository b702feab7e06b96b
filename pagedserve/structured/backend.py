"""GrammarBackend: what the engine core asks of its structured-outputs side.

Two classes answer it: `StructuredOutputManager` (the matchers in the engine core's process,
the CPU's default) and `GrammarProcess` (the same manager in a child process, the GPU's
default, so its worker threads never take the engine thread's interpreter lock). The core
holds one of them and calls only these methods, so either can stand in for the other and a
third (another grammar library) would implement this and nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from pagedserve.structured.grammar import GrammarCache
from pagedserve.structured.manager import GrammarOutput


class GrammarBackend(Protocol):
    """A step's grammar work: requests are added (their grammar compiles in the background),
    each step's sampled tokens advance their matchers, and a step's sampling rows get their
    bitmask. `submit` queues that work and returns; `take_bitmask` waits for it."""

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache of this process (the frontend validates specs on it)."""

    @property
    def stop_token_ids(self) -> list[int] | None:
        """The tokens a finished grammar allows (None: those xgrammar detects)."""

    def add_request(self, request: Any) -> None:
        """Start a request's grammar if it asks for structured outputs; returns at once."""

    def remove_request(self, request_id: str) -> None:
        """Forget the request (finished, aborted, or its compile no longer wanted)."""

    def has_requests(self) -> bool:
        """Some request is constrained now, or watched for the marker its grammar starts
        after (its tokens must still be submitted)."""

    def has_compiles(self) -> bool:
        """Some request waits for its grammar, or `take_compiled` has news."""

    def take_compiled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """The requests ready since the last call, and (request id, error) for those whose
        compile failed. Never waits."""

    def is_constrained(self, request_id: str, num_unseen: int = 0) -> bool:
        """The request's next token is masked by its grammar, or (a grammar that starts after
        a marker) may be once its `num_unseen` tokens in flight are submitted."""

    def grammar_bitmask(self, req_ids: Sequence[str],
                        drafts: dict[str, list[int]] | None = None) -> GrammarOutput | None:
        """The bitmask of a step's sampling rows, now (`submit` then `take_bitmask`)."""

    def submit(self, requests: Iterable[Any] = (),
               sampling_ids: Sequence[str] | None = None,
               drafts: dict[str, list[int]] | None = None,
               num_new: Sequence[int] | None = None) -> None:
        """Advance the matchers of `requests` by the tokens each received (its last
        `num_new` output tokens; None: its last one), then, if `sampling_ids` is given, fill
        those rows' bitmask: k + 1 rows for a row verifying k `drafts` (speculative
        decoding), the masks of the states its drafts lead to. Returns at once."""

    def take_bitmask(self) -> GrammarOutput | None:
        """The bitmask of the last `submit` with rows; None if none of them is constrained."""

    def set_num_threads(self, num_threads: int) -> None:
        """The grammar worker count between steps (0: the work on the calling thread)."""

    def shutdown(self) -> None:
        """Stop the workers (or the child process); a later request starts them again."""
