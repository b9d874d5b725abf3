"""Which programmatic-dependent-launch arguments the Triton launchers get (the kernels' USE_PDL constant)."""
from __future__ import annotations

import pytest

from dflash2.kernels.triton import pdl


@pytest.fixture(autouse=True)
def fresh_cache():
    pdl.pdl_args.cache_clear()
    yield
    pdl.pdl_args.cache_clear()


def test_off_without_a_hopper_gpu_or_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_enabled", lambda: False)
    assert pdl.pdl_args() == {"USE_PDL": False}  # no launch option: a plain launch


def test_on_with_the_launch_option(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_enabled", lambda: True)
    assert pdl.pdl_args() == {"USE_PDL": True, "launch_pdl": True}


def test_off_by_switch_and_under_the_interpreter(monkeypatch):
    pdl.pdl_enabled.cache_clear()
    monkeypatch.setenv("DFLASH2_PDL", "0")
    assert not pdl.pdl_enabled()
    pdl.pdl_enabled.cache_clear()
    monkeypatch.delenv("DFLASH2_PDL")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled()
    pdl.pdl_enabled.cache_clear()
