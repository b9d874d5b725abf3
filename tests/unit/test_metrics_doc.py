"""docs/METRICS.md lists exactly the metric families the server registers, with their types."""
from __future__ import annotations

import re
from pathlib import Path

from dflash2.server.gc_pauses import SERVER_GC_PAUSE_METRIC
from dflash2.server.metrics import ServerMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"


def test_the_metrics_table_matches_the_registry():
    rows = dict(re.findall(r"^\| `(dflash2_\w+)` \| (\w+) \|", DOC.read_text(), flags=re.MULTILINE))
    registered = {family.name: family.type for family in ServerMetrics("m").registry.collect()}
    registered[SERVER_GC_PAUSE_METRIC] = "histogram"  # the HTTP process's own registry
    assert rows == registered
