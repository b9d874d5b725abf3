"""Grammar engines for structured output on the bundled model's vocabulary (49,152 tokens), on the CPU: set-up, the
time to compile a JSON schema, and the time to build one step's token mask along a valid output. Prints JSON.

    python benchmarks/grammar_engines.py [--output benchmarks/results/grammar_engines.json]

xgrammar is a dependency; llguidance and outlines-core are measured when importable (e.g. installed with
`pip install --target DIR llguidance==1.9.1 outlines-core==0.2.14` and DIR on PYTHONPATH). Why dflash2 uses
xgrammar: docs/OPENAI_FEATURES.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "population": {"type": "integer"}, "coastal": {"type": "boolean"},
    "districts": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "area_km2": {"type": "number"}}, "required": ["name", "area_km2"]}}},
    "required": ["name", "population", "coastal", "districts"]}
OUTPUT = '{"name": "Lisbon", "population": 545923, "coastal": true, "districts": [{"name": "Belem", ' \
         '"area_km2": 10.4}, {"name": "Alfama", "area_km2": 0.9}]}'


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def measure_xgrammar(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                   stop_token_ids=[tokenizer.eos_token_id]))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    masks = []
    for token_id in token_ids:
        masks.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0))[1])
        assert matcher.accept_token(token_id)
    return _report(setup, compile_s, masks)


def measure_llguidance(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltokenizer, setup = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(lltokenizer, grammar))
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    masks = []
    for token_id in token_ids:
        masks.append(timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0))[1])
        assert matcher.consume_token(token_id), matcher.get_error()
    return _report(setup, compile_s, masks)


def measure_outlines_core(tokenizer: Any, vocab_size: int, token_ids: list[int]) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary, setup = timed(lambda: _outlines_vocabulary(tokenizer, Vocabulary))
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
    index, compile_s = timed(lambda: Index(regex, vocabulary))
    guide = Guide(index)
    masks = []
    for token_id in token_ids:
        allowed, seconds = timed(guide.get_tokens)
        masks.append(seconds)
        assert token_id in allowed
        if token_id != tokenizer.eos_token_id:  # (its final state has no next state)
            guide.advance(token_id)
    return _report(setup, compile_s, masks)


def _outlines_vocabulary(tokenizer: Any, vocabulary_class: Any) -> Any:
    """outlines-core's Vocabulary of a byte-level BPE tokenizer: each token as its bytes."""
    decoder = _byte_level_decoder()
    by_bytes: dict[bytes, list[int]] = {}
    special = set(tokenizer.all_special_ids)
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        by_bytes.setdefault(bytes(decoder[c] for c in token if c in decoder), []).append(token_id)
    by_bytes.pop(b"", None)
    return vocabulary_class(tokenizer.eos_token_id, by_bytes)


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's characters -> the bytes they stand for: printable bytes stand for themselves, the others
    were moved to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    decoder = {chr(byte): byte for byte in printable}
    moved = [byte for byte in range(256) if byte not in set(printable)]
    decoder.update({chr(256 + index): byte for index, byte in enumerate(moved)})
    return decoder


def _report(setup_s: float, compile_s: float, masks_s: list[float]) -> dict[str, float]:
    return {"setup_s": round(setup_s, 4), "compile_schema_s": round(compile_s, 4),
            "mask_mean_us": round(1e6 * statistics.mean(masks_s), 1),
            "mask_p99_us": round(1e6 * sorted(masks_s)[int(0.99 * (len(masks_s) - 1))], 1),
            "mask_first_us": round(1e6 * masks_s[0], 1), "num_masks": len(masks_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    import torch

    from dflash2.loading.tokenizer import bundled_model_path, load_tokenizer

    torch.set_num_threads(2)
    tokenizer = load_tokenizer(bundled_model_path())
    vocab_size = 49152
    token_ids = tokenizer.encode(OUTPUT, add_special_tokens=False) + [tokenizer.eos_token_id]
    report: dict[str, Any] = {"vocab_size": vocab_size, "output_tokens": len(token_ids), "engines": {}}
    for name, measure in (("xgrammar", measure_xgrammar), ("llguidance", measure_llguidance),
                          ("outlines_core", measure_outlines_core)):
        try:
            report["engines"][name] = measure(tokenizer, vocab_size, token_ids)
        except ImportError as e:
            report["engines"][name] = {"skipped": f"not installed ({e.name})"}
        except Exception as e:  # noqa: BLE001 - one engine's failure is part of the comparison
            report["engines"][name] = {"failed": f"{type(e).__name__}: {e}"[:300]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
