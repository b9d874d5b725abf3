"""`dflash2 generate`: offline generation for one prompt or a jsonl file of them."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dflash2.cli.args import add_engine_flags, add_flag, engine_kwargs

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "min_tokens", "stop", "stop_token_ids",
                   "ignore_eos", "logprobs")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="generate text offline (no server)")
    source = parser.add_mutually_exclusive_group(required=True)
    add_flag(source, "--prompt", help="one prompt")
    add_flag(source, "--input", help="jsonl: lines with prompt, prompt_token_ids or messages, plus sampling fields")
    add_flag(parser, "--output", help="jsonl results (default: text to stdout)")
    add_flag(parser, "--chat", action="store_true", help="treat --prompt as a user message and apply the chat template")
    add_flag(parser, "--max-tokens", type=int, default=128)
    add_flag(parser, "--temperature", type=float, default=0.0)
    add_flag(parser, "--top-p", type=float, default=1.0)
    add_flag(parser, "--top-k", type=int, default=0)
    add_flag(parser, "--min-p", type=float, default=0.0)
    add_flag(parser, "--repetition-penalty", type=float, default=1.0)
    add_flag(parser, "--sampling-seed", dest="sampling_seed", type=int, default=None)
    add_flag(parser, "--stop", action="append", default=None)
    add_flag(parser, "--ignore-eos", action="store_true")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dflash2 import LLM, SamplingParams
    from dflash2.cpu_threads import use_engine_threads

    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
                    stop=args.stop, ignore_eos=args.ignore_eos)
    items = _read_items(args)
    use_engine_threads(args.num_threads)
    llm = LLM(**engine_kwargs(args))
    prompts, params = [], []
    for item in items:
        prompts.append(_prompt_of(llm, item, args.chat))
        params.append(SamplingParams(**{**defaults, **{k: item[k] for k in SAMPLING_FIELDS if k in item}}))
    outputs = llm.generate(prompts, params)
    _write(args, items, outputs)
    return 0


def _read_items(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.prompt is not None:
        return [{"prompt": args.prompt}]
    items = []
    with open(args.input) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.input}:{number}: not valid JSON ({e.msg})") from None
    if not items:
        raise ValueError(f"{args.input} holds no prompts")
    return items


def _prompt_of(llm: Any, item: dict[str, Any], chat: bool) -> Any:
    if "messages" in item:
        return {"prompt_token_ids": llm.apply_chat_template(item["messages"])}
    if "prompt_token_ids" in item:
        return {"prompt_token_ids": item["prompt_token_ids"]}
    if "prompt" not in item:
        raise ValueError("each input line needs prompt, prompt_token_ids or messages")
    if chat:
        return {"prompt": item["prompt"],
                "prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": item["prompt"]}])}
    return item["prompt"]


def _write(args: argparse.Namespace, items: list[dict[str, Any]], outputs: list[Any]) -> None:
    if args.output is None:
        for output in outputs:
            sys.stdout.write(output.outputs[0].text + "\n")
        return
    with open(args.output, "w") as f:
        for item, output in zip(items, outputs):
            completion = output.outputs[0]
            row = {**{k: v for k, v in item.items() if k in ("id", "prompt", "messages")},
                   "text": completion.text, "token_ids": completion.token_ids,
                   "finish_reason": completion.finish_reason,
                   "num_prompt_tokens": len(output.prompt_token_ids)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
