"""The penalty rule the sampler's torch path and the filtered sampling kernel both apply, and
one step's view of the penalty counts it reads (`PenaltyTensors`; the counts themselves live
in device/penalties.py's `PenaltyState`). Here, below both, so the kernel does not import
the sampler's layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def to_device(cpu: Tensor, device: torch.device) -> Tensor:
    """Copy through pinned memory without waiting: a copy from pageable memory to a GPU
    blocks the host until the stream has drained, a sync in the middle of the step."""
    if device.type != "cuda":
        return cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


@dataclass
class PenaltyTensors:
    """Per-row penalties for one step: each row's slot in the `PenaltyState` counts (-1:
    the row has no penalties) and its three factors (neutral on rows without)."""

    rows: Tensor  # int64 [S]
    output_counts: Tensor  # int32 [slots, V]: the sampled tokens of each slot, counted
    prompt_mask: Tensor  # bool [slots, V]: the tokens of each slot's prompt
    repetition: Tensor  # float32 [S]
    presence: Tensor  # float32 [S]
    frequency: Tensor  # float32 [S]
    penalized_rows: list[int]  # the rows with a slot, known on the host (no device read)


def apply_penalties(logits: Tensor, penalties: PenaltyTensors) -> Tensor:
    """Repetition (tokens of the prompt or output: divide positive, multiply negative
    logits), then frequency (times the output count) and presence (seen in the output)
    subtracted, in float32. Rows without penalties (slot -1) are left as they are."""
    has_slot = (penalties.rows >= 0).unsqueeze(1)
    slots = penalties.rows.clamp(min=0)
    counts = penalties.output_counts.index_select(0, slots)
    counts = torch.where(has_slot, counts, 0).to(logits.dtype)
    seen = has_slot & (penalties.prompt_mask.index_select(0, slots) | (counts > 0))
    rep = penalties.repetition.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * counts
    return logits - penalties.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
