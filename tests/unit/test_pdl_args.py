"""Which programmatic-dependent-launch mode the Triton launchers get (the kernels' USE_PDL constant)."""
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
    monkeypatch.setenv("DFLASH2_PDL_LAUNCH_FIRST", "1")
    assert pdl.pdl_args() == {"USE_PDL": pdl.PDL_OFF}  # no launch option: a plain launch


@pytest.mark.parametrize("value, mode", [(None, pdl.PDL_WAIT_FIRST), ("0", pdl.PDL_WAIT_FIRST),
                                         ("1", pdl.PDL_LAUNCH_FIRST)])
def test_wait_first_unless_launch_first_is_asked_for(monkeypatch, value, mode):
    monkeypatch.setattr(pdl, "pdl_enabled", lambda: True)
    if value is None:
        monkeypatch.delenv("DFLASH2_PDL_LAUNCH_FIRST", raising=False)
    else:
        monkeypatch.setenv("DFLASH2_PDL_LAUNCH_FIRST", value)
    assert pdl.pdl_args() == {"USE_PDL": mode, "launch_pdl": True}
