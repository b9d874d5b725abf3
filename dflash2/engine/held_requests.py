"""HeldRequests: requests the engine has taken but not yet handed to their scheduler, each until a condition holds.

    add_request ──► hold(request, until) ──► (each step) release() ──► Scheduler.add
                    e.g. a sample waiting for its leader's prompt KV (parallel_sampling.py),
                         a request waiting for its grammar to compile (guided.py)

A held request has no pages and no slot; aborting it only drops it from here. The engine counts held requests as
waiting (queue bounds) and unfinished (it keeps stepping until they are released and done).
"""
from __future__ import annotations

from collections.abc import Callable

from dflash2.request import Request


class HeldRequests:
    def __init__(self) -> None:
        self._held: dict[str, tuple[Request, list[Callable[[], bool]]]] = {}

    def hold(self, request: Request, until: Callable[[], bool]) -> None:
        """Keep `request` until `until()` is true (a second condition for the same request adds to the first)."""
        entry = self._held.setdefault(request.request_id, (request, []))
        entry[1].append(until)

    def release(self) -> list[Request]:
        """The requests whose every condition holds now, in the order they were held; they leave."""
        ready = [request_id for request_id, (_, conditions) in self._held.items()
                 if all(condition() for condition in conditions)]
        return [self._held.pop(request_id)[0] for request_id in ready]

    def drop(self, request_id: str) -> bool:
        """Forget a request (aborted); False if it was not held."""
        return self._held.pop(request_id, None) is not None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)


def prompt_computed(leader: Request) -> Callable[[], bool]:
    """True once the leader's prompt KV is committed (its first token is known: its full prompt pages are in the
    prefix cache then), or once it ended (aborted or finished early): the samples then compute their own."""
    first = leader.num_prompt_tokens

    def ready() -> bool:
        return leader.status.finished or (len(leader.token_ids) > first and leader.token_ids[first] >= 0)

    return ready
