"""StepPlan: the only thing that crosses from scheduling into execution (plain data, no tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # made for every request every step: slots, not frozen, keep it cheap
class ScheduledChunk:
    """Compute KV for tokens [start, start + len(token_ids)) of one request.

    The request's page table is row `slot` of the runner's page table; `new_page_ids` are the pages to write
    into that row from index `new_pages_start` on (pages allocated since the request's previous chunk).
    `sample` is True when the chunk ends at the request's last known token, so its last position yields the
    next token. `all_logits` asks for logits at every position (prompt logprobs). A negative token id is a
    placeholder for a token still being sampled on the device (overlapped steps).
    """

    request_id: str
    start: int
    token_ids: tuple[int, ...]
    slot: int
    new_pages_start: int
    new_page_ids: tuple[int, ...]
    sample: bool
    all_logits: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start > 0


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to waiting this step
    swapped: list[str] = field(default_factory=list)  # of those, the ones whose KV went to host pages
    resumed: list[str] = field(default_factory=list)  # swapped requests brought back this step
    # Page copies the runner makes before the step's kernels: out first, then in.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device page, host page)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host page, device page)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.swap_out or self.swap_in)
