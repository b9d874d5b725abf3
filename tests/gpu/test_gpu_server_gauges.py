"""On a CUDA device: the real server's GPU gauges (NVML through nvidia-ml-py) and the per-token log's
gpu_sm_util (issue 47, item 6)."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.integration.server_process import API_KEY, ServerProcess

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def server():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    process = ServerProcess("--model", "qwen3-0.6b", "--load-format", "dummy", "--kv-cache-memory", "1GiB",
                            "--max-model-len", "4096", "--log-tokens", "--api-key", API_KEY).start()
    yield process
    process.cleanup()


def test_gpu_gauges_report_memory_power_and_utilization(server):
    body = {"model": "qwen3-0.6b", "prompt": [1, 2, 3, 4], "max_tokens": 64, "ignore_eos": True}
    for _ in range(3):
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 200, response.text
    used = server.wait_for_metric("dflash2_gpu_memory_used_bytes", lambda v: v is not None and v > 0, gpu="0")
    assert used is not None and used > 1 << 30  # the weights and the 1 GiB pool at least
    power = server.wait_for_metric("dflash2_gpu_power_draw_watts", lambda v: v is not None and v > 0, gpu="0")
    assert power is not None and 10 < power < 1500
    busy = server.metric("dflash2_gpu_utilization", gpu="0")
    assert busy is not None and 0 <= busy <= 100
    tokens = [record for record in server.json_logs() if record.get("event") == "token"]
    assert len(tokens) == 3 * 64
    with_util = [record for record in tokens if "gpu_sm_util" in record]
    assert with_util and all(0 <= record["gpu_sm_util"] <= 100 for record in with_util)
