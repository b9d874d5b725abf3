"""benchmarks/tune_decode.py --w1-data: decode rows in the pages the engine would hand out."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.tune_decode import engine_pages  # noqa: E402


def test_prompt_pages_come_in_runs_and_decode_pages_interleave_in_step_order():
    # 4 tokens a page. Prefill: request 0 (5 tokens) takes pages 0-1, request 1 (3) page 2, request 2 (8) pages
    # 3-4. Decoding, one token a step each: request 2 reaches its 9th token at step 1 (page 5), request 1 its
    # 5th at step 2 (page 6), request 0 its 9th at step 4 (page 7).
    tables, lengths = engine_pages([5, 3, 8], decoded=4, tokens_per_page=4)
    assert lengths == [12, 9, 7]  # longest first, as the runner orders decode rows
    assert tables == [[3, 4, 5], [0, 1, 7], [2, 6]]
