"""How many torch threads each process of ours runs, chosen for the machine rather than left to torch.

    process that runs the engine (the server's engine process,   torch intra-op threads = --num-threads, else
    `dflash2 generate`, the server with --single-process)         the physical cores available to the process
    the server's HTTP process (when the engine has its own)        1: it runs no tensor work, so no pool at all

The physical cores available: the CPUs of the process's affinity mask counted once per physical core
(hyperthread siblings share one), capped by its cgroup's CPU quota (a container given 1.5 CPUs of a 64-core
host gets 1 thread, not 64).

Why it matters on a small CPU: torch's OpenMP workers spin (libgomp's `pause` loop) for a while after each
parallel region, and a region's barrier waits for every worker. With the engine's threads on every core,
anything else that runs (the HTTP process, the client, another program) takes a core from one of them, and
its partner spins at the barrier until it gets the core back: on the 2-core dev machine, one busy process
beside the offline engine cut it from 28 to 8-10 tok/s (threads 2), against 16-19 with 1 thread
(benchmarks/RESULTS.md, "C1 server"). Threads beyond the cores available only add such waits; the HTTP
process's own pool would be one more set of spinners. `--num-threads` sets the engine's count (1 on a machine
shared with other busy programs).
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger("dflash2")

_CPU_SYSFS = Path("/sys/devices/system/cpu")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


def physical_cores_available() -> int:
    """Physical cores in this process's CPU affinity, capped by its cgroup CPU quota (at least 1)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity on this platform)
        cpus = list(range(os.cpu_count() or 1))
    cores = {_core_of(cpu) for cpu in cpus}
    count = len(cpus) if None in cores else len(cores)
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)


def _core_of(cpu: int) -> tuple[str, str] | None:
    """(package id, core id) of a logical CPU, or None where sysfs does not say."""
    topology = _CPU_SYSFS / f"cpu{cpu}" / "topology"
    try:
        return ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
    except OSError:
        return None


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroup may use (cgroup v2 cpu.max, v1 cfs quota; the smallest along
    its path, as the kernel applies every ancestor's); None: no limit."""
    quotas = [quota for quota in map(_read_quota, _cgroup_dirs()) if quota is not None]
    return min(quotas, default=None)


def _cgroup_dirs() -> list[Path]:
    """Where this process's CPU controller files may be: its cgroup's directory and each one above it."""
    try:
        lines = _PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            mounts = [_CGROUP_ROOT]
        elif "cpu" in controllers.split(","):  # v1
            mounts = [_CGROUP_ROOT / "cpu", _CGROUP_ROOT / "cpu,cpuacct"]
        else:
            continue
        parts = Path(path).relative_to("/").parts if path.startswith("/") else Path(path).parts
        for mount in mounts:
            dirs += [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return dirs


def _read_quota(directory: Path) -> float | None:
    try:
        return parse_cpu_max((directory / "cpu.max").read_text())
    except OSError:
        pass
    try:
        return parse_cfs_quota((directory / "cpu.cfs_quota_us").read_text(),
                               (directory / "cpu.cfs_period_us").read_text())
    except OSError:
        return None


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("max 100000" or "150000 100000") as CPUs; None: no limit."""
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return int(fields[0]) / int(fields[1])


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` as CPUs; None: no limit (-1)."""
    quota, period = int(quota_text), int(period_text)
    return None if quota <= 0 or period <= 0 else quota / period


def check_num_threads(num_threads: int | None) -> None:
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {num_threads}")


def use_engine_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads for a process that runs the engine: `num_threads`, else the physical cores
    available. Returns the count, logged with where it came from."""
    import torch

    check_num_threads(num_threads)
    cores = physical_cores_available()
    count = num_threads if num_threads is not None else cores
    torch.set_num_threads(count)
    source = "--num-threads" if num_threads is not None else "the physical cores available (--num-threads to change)"
    logger.info("engine: torch threads %d (%s; %d physical cores available to this process, pid %d)",
                torch.get_num_threads(), source, cores, os.getpid())
    return torch.get_num_threads()


def use_one_thread() -> None:
    """A process with no tensor work of its own (the server's HTTP side): torch at one thread, so it has no
    OpenMP workers that could spin beside the engine's."""
    import torch

    torch.set_num_threads(1)
    logger.info("HTTP process: torch threads 1 (pid %d)", os.getpid())
