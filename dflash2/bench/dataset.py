"""Bench datasets: jsonl lines with `prompt` or `prompt_token_ids`, `max_tokens`, optional `priority`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash2.request import check_priority

# Shipped with the repository: 100 prompts, priorities 0 / 100 / 1000 in proportions 70 / 20 / 10.
SAMPLE_DATASET = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "sample.jsonl"
DEFAULT_MAX_TOKENS = 64


@dataclass(frozen=True)
class BenchItem:
    prompt: str | list[int]
    max_tokens: int
    priority: int = 0


def load_dataset(path: str | Path | None, max_tokens: int | None = None) -> list[BenchItem]:
    """Read a dataset (default: the shipped sample); `max_tokens` overrides every line's. ValueError on bad lines."""
    path = Path(path) if path is not None else SAMPLE_DATASET
    if not path.is_file():
        raise FileNotFoundError(f"no such dataset: {path}")
    items = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                items.append(_item(_parse(line, path, number), f"{path}:{number}", max_tokens))
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return items


def _parse(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{number}: each line must be a JSON object")
    return row


def _item(row: dict, where: str, max_tokens: int | None) -> BenchItem:
    prompt = row.get("prompt", row.get("prompt_token_ids"))
    if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt
                                                         and all(isinstance(t, int) for t in prompt)):
        raise ValueError(f"{where}: needs a non-empty 'prompt' string or 'prompt_token_ids' list")
    tokens = max_tokens if max_tokens is not None else row.get("max_tokens", DEFAULT_MAX_TOKENS)
    priority = row.get("priority", 0)
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer, got {tokens!r}")
    try:
        check_priority(priority)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return BenchItem(prompt, tokens, priority)
