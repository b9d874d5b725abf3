"""Add the peer's JSON (from the same device call) to one of our result files, with the ratio.

    python3 benchmarks/attach_peer.py benchmarks/results/w1_....json /work/.device/N/peer_w1.json
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    result_path, peer_path = sys.argv[1], sys.argv[2]
    with open(result_path) as f:
        result = json.load(f)
    with open(peer_path) as f:
        peer = json.loads([line for line in f.read().splitlines() if line.startswith("{")][-1])
    key = "out_tok_s" if result["workload"] == "w1" else "tok_s"
    result["peer"] = peer
    result["ratio_to_peer"] = round(result[key] / peer[key], 2)
    with open(result_path, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"workload": result["workload"], key: result[key], "peer": peer[key],
                      "ratio": result["ratio_to_peer"]}))


if __name__ == "__main__":
    main()
