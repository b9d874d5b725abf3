"""benchmarks/kernel_times.py's exposed-time accounting."""
from __future__ import annotations

from benchmarks.kernel_times import exposed_table


def test_each_kernel_is_charged_for_how_far_it_moves_the_latest_end():
    # a: 0-10; b runs under a; c overlaps a's end (charged 10 -> 15); an idle gap 15-20 is nobody's; a again 20-22
    events = [(0.0, 10.0, "a"), (2.0, 5.0, "b"), (8.0, 15.0, "c"), (20.0, 22.0, "a")]
    rows, busy = exposed_table(events, steps=1)
    assert rows == [{"kernel": "a", "exposed_us_per_step": 12.0}, {"kernel": "c", "exposed_us_per_step": 5.0},
                    {"kernel": "b", "exposed_us_per_step": 0.0}]
    assert busy == 17.0
    rows, busy = exposed_table(events, steps=2)
    assert rows[0] == {"kernel": "a", "exposed_us_per_step": 6.0} and busy == 8.5
