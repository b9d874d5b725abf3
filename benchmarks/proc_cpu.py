"""CPU seconds of a process, of the processes below it and of its whole tree, from /proc (server_host_cost.py:
the server path's host time a token; cpu_server.py: the CPU the machine's other processes took)."""
from __future__ import annotations

import os
from pathlib import Path


def own_cpu_s(pid: int) -> float:
    """User + system seconds of the process (all its threads), not of its children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every process below it."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += own_cpu_s(current)
            todo += children(current)
        except OSError:
            pass  # gone meanwhile
    return total


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]
