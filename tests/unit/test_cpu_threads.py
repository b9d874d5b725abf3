"""cpu_threads: the thread counts chosen for the machine, and the --num-threads flag."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from dflash2 import cpu_threads
from dflash2.cli.args import add_engine_flags
from dflash2.server.config import ServerConfig


def test_cgroup_quotas_parse_as_cpus():
    assert cpu_threads.parse_cpu_max("max 100000\n") is None
    assert cpu_threads.parse_cpu_max("150000 100000\n") == 1.5
    assert cpu_threads.parse_cfs_quota("-1\n", "100000\n") is None
    assert cpu_threads.parse_cfs_quota("200000\n", "100000\n") == 2.0


def test_the_smallest_quota_along_the_cgroup_path_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cpu_threads, "_PROC_CGROUP", tmp_path / "self_cgroup")
    (tmp_path / "self_cgroup").write_text("0::/outer/inner\n")
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    (tmp_path / "outer" / "inner" / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.cgroup_cpu_quota() is None
    (tmp_path / "outer" / "cpu.max").write_text("300000 100000\n")
    assert cpu_threads.cgroup_cpu_quota() == 3.0
    (tmp_path / "self_cgroup").write_text("4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n")  # cgroup v1
    v1 = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_threads.cgroup_cpu_quota() == 0.5


def test_physical_cores_count_siblings_once_and_follow_the_quota(monkeypatch):
    cores = {0: ("0", "0"), 1: ("0", "0"), 2: ("0", "1"), 3: ("0", "1"), 4: ("1", "0"), 5: ("1", "0")}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.setattr(cpu_threads, "_core_of", cores.get)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert cpu_threads.physical_cores_available() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # two cores of the first package
    assert cpu_threads.physical_cores_available() == 2
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 1.5)  # a container's 1.5 CPUs: one thread
    assert cpu_threads.physical_cores_available() == 1
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 0.25)
    assert cpu_threads.physical_cores_available() == 1
    monkeypatch.setattr(cpu_threads, "_core_of", lambda cpu: None)  # no topology: logical CPUs
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert cpu_threads.physical_cores_available() == 3


def test_this_machine_has_at_least_one_core():
    assert 1 <= cpu_threads.physical_cores_available() <= (os.cpu_count() or 1)


def test_engine_threads_default_to_the_cores_and_follow_the_flag(caplog):
    previous = torch.get_num_threads()
    try:
        with caplog.at_level("INFO", logger="dflash2"):
            assert cpu_threads.use_engine_threads(1) == 1 == torch.get_num_threads()
            assert cpu_threads.use_engine_threads(None) == cpu_threads.physical_cores_available()
        assert "engine: torch threads 1 (--num-threads;" in caplog.text
        assert "the physical cores available (--num-threads to change)" in caplog.text
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="--num-threads must be >= 1"):
        cpu_threads.use_engine_threads(0)


def test_num_threads_flag_both_spellings():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert parser.parse_args([]).num_threads is None
    assert parser.parse_args(["--num-threads", "3"]).num_threads == 3
    assert parser.parse_args(["--num_threads", "1"]).num_threads == 1
    with pytest.raises(ValueError, match="--num-threads must be >= 1"):
        ServerConfig(num_threads=0)
