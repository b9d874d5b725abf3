"""WorkerFailed: a rank of a parallel engine died, hung or fell out of step; the engine cannot run steps any more."""
from __future__ import annotations


class WorkerFailed(RuntimeError):
    """Its message says which rank and why; the server ends the requests in flight with it and /health says it."""
