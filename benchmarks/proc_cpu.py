"""CPU seconds of a process and of each process below it, as JSON: what the server path costs the host.

    python3 benchmarks/proc_cpu.py PID      ->  {"pid": PID, "self_s": 12.3, "children_s": {"PID2": 40.1}}

Run before and after a load against `dflash2 serve` (PID: the HTTP process; its child is the engine process):
the differences over the tokens served are the host time a token costs on each side (issue 44, item 2).
"""
from __future__ import annotations

import json
import os
import sys
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


def main() -> None:
    pid = int(sys.argv[1])
    print(json.dumps({"pid": pid, "self_s": own_cpu_s(pid),
                      "children_s": {str(child): tree_cpu_s(child) for child in children(pid)}}))


if __name__ == "__main__":
    main()
