"""PenaltyState: each penalized request's token counts, kept on the sampler's device.

The repetition / presence / frequency penalties need, per request, which tokens its prompt
holds and how often each token was generated. Read from the host's token lists they would
make every step wait for the previous step's token, which is exactly what async scheduling
avoids. So the runner gives each request with penalties a slot here when it first samples,
updates the counts from the sampled token tensor on the device after every step (queued
work, no host round trip), and frees the slot when the request finishes. A preempted
request keeps its slot: its tokens stay its tokens.

Slot 0 is spare: the update sends the rows of requests without penalties there, so one
scatter serves the whole batch without selecting rows on the host.

`PenaltyTensors` (kernels/penalties.py) is one step's view of those counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedserve.kernels.penalties import to_device

_SPARE = 0


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        """Slots grow by doubling from `initial_slots`; nothing is allocated until the first
        request with penalties arrives."""
        self.vocab_size = vocab_size
        self.device = device
        self._initial_slots = initial_slots
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, request_id: str, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int] = ()) -> int:
        """Give a request a slot holding its prompt's tokens and the outputs it already has
        (a resumed request's); returns the slot."""
        if request_id in self._slots:
            raise ValueError(f"request {request_id} already has a penalty slot")
        slot = self._free.pop() if self._free else self._new_slot()
        self._slots[request_id] = slot
        self.prompt_mask[slot].zero_()
        self.output_counts[slot].zero_()
        if prompt_token_ids:
            # index_fill_, not `mask[slot, ids] = True`: that index_put waits for the device
            self.prompt_mask[slot].index_fill_(0, self._upload(prompt_token_ids), True)
        if output_token_ids:
            ids = self._upload(output_token_ids)
            self.output_counts[slot].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return slot

    def remove(self, request_id: str) -> None:
        """Free a finished request's slot; unknown ids are ignored."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, request_ids: Sequence[str]) -> list[int]:
        """Each request's slot, -1 for requests without one."""
        return [self._slots.get(r, -1) for r in request_ids]

    def update(self, slots: Tensor, sampled_token_ids: Tensor) -> None:
        """Count each row's sampled token in its slot (slots: int64 [S] on the device, -1
        for rows without penalties); queued on the device, nothing waits."""
        slots = torch.where(slots >= 0, slots, _SPARE)
        flat = slots * self.vocab_size + sampled_token_ids
        self.output_counts.view(-1).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))

    def through_drafts(self, slots: Sequence[int], drafts: Sequence[Sequence[int]]
                       ) -> tuple[PenaltyState, list[int]]:
        """The counts at each position of speculative verifies, as a throwaway state with a
        slot per position: a request's position j counts its outputs and its first j drafts
        (those accepted before it, if it is reached at all), so each position is penalized
        as it would be one token a step. `slots`: each verified request's slot here (-1:
        no penalties), `drafts` its drafts; returns the state and each position's slot in
        it (k + 1 per request, -1 where its request has none)."""
        view = PenaltyState(self.vocab_size, self.device, initial_slots=0)
        sources, positions, rows, tokens = [], [], [], []
        for slot, request_drafts in zip(slots, drafts):
            num = len(request_drafts) + 1
            if slot < 0:
                positions += [-1] * num
                continue
            first = len(sources)
            sources += [slot] * num
            positions += range(first, first + num)
            for j in range(1, num):  # position j: drafts 0 .. j - 1 counted
                rows += [first + j] * j
                tokens += request_drafts[:j]
        if not sources:
            return view, positions
        index = self._upload(sources)
        view.output_counts = self.output_counts.index_select(0, index)
        view.prompt_mask = self.prompt_mask.index_select(0, index)
        if rows:
            view.output_counts.index_put_(
                (self._upload(rows), self._upload(tokens)),
                torch.ones(len(rows), dtype=torch.int32, device=self.device), accumulate=True)
        return view, positions

    def count(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Count tokens a request received outside the sampler (a verify's accepted
        drafts and the token after them)."""
        slot = self._slots[request_id]
        ids = self._upload(token_ids)
        self.output_counts[slot].index_put_(
            (ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def _new_slot(self) -> int:
        used = 1 + len(self._slots) + len(self._free)  # the spare slot included
        capacity = self.output_counts.shape[0]
        if used == capacity or capacity == 0:
            self._grow(max(self._initial_slots + 1, 2 * capacity))
        return used

    def _grow(self, capacity: int) -> None:
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        old = self.output_counts.shape[0]
        counts[:old] = self.output_counts
        mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask

    def _upload(self, token_ids: Sequence[int]) -> Tensor:
        return to_device(torch.tensor(list(token_ids), dtype=torch.int64), self.device)
