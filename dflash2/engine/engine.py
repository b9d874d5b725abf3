"""Engine: owns the requests and runs the step loop   plan -> execute -> commit.

    add_request() ─► Scheduler.waiting
    step():  Scheduler.plan() ─► StepPlan ─► ModelRunner.execute() ─► StepResult ─► _commit()
             _commit appends tokens, checks stop conditions, frees finished requests' pages and
             returns one RequestOutput per request that produced something this step.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash2.config import CacheConfig, SchedulerConfig
from dflash2.engine.detokenizer import IncrementalDetokenizer
from dflash2.engine.kv.layout import KVLayout, resolve_kv_dtype
from dflash2.engine.kv.manager import KVManager
from dflash2.engine.kv.page_pool import PagePool
from dflash2.engine.plan import StepPlan
from dflash2.engine.runner import ModelRunner, StepResult
from dflash2.engine.sampler import make_generator
from dflash2.engine.scheduler import Scheduler
from dflash2.loading.model_loader import load_model
from dflash2.request import CompletionOutput, Request, RequestOutput, RequestStatus
from dflash2.sampling_params import SamplingParams

logger = logging.getLogger("dflash2")

PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or preset name (dummy); None: the bundled model
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        device = resolve_device(config.device)
        self.model = load_model(config.model, config.load_format, config.dtype, device,
                                config.scheduler.max_model_len, config.seed, config.tokenizer)
        self.tokenizer = self.model.tokenizer
        self.max_model_len = self._max_model_len()
        layout = KVLayout.for_model(self.model.arch, resolve_kv_dtype(config.cache.kv_cache_dtype, self.model.dtype),
                                    config.cache.page_bytes)
        num_pages = self._num_pages(layout, device)
        self.pool = PagePool(num_pages, layout.page_bytes)
        self.kv = KVManager(self.pool, layout.tokens_per_page, self.model.name, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        backend = "torch" if config.attention_backend == "auto" else config.attention_backend
        self.eos_token_ids = set(self._eos_token_ids())
        self.runner = ModelRunner(self.model, layout, num_pages, backend, config.seed)
        self.runner.eos_token_ids = tuple(sorted(self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        logger.info("model %s: %d layers, KV %s, %d pages of %d tokens (%d tokens), max_model_len %d",
                    self.model.name, self.model.arch.num_layers, layout.dtype, num_pages, layout.tokens_per_page,
                    num_pages * layout.tokens_per_page, self.max_model_len)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None, priority: int = 0,
                    request_id: str | None = None) -> Request:
        """Validate and queue one request; raises ValueError saying what is wrong with it."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        request = Request(request_id, token_ids, params, priority=priority, prompt=prompt_text,
                          model=self.model.name)
        if params.seed is not None:
            request.generator = make_generator(params.seed, self.model.device)
        self.requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.status.finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._detokenizers.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.plan()
        if not plan:
            return []
        result = self.runner.execute(plan, self.requests)
        self.scheduler.on_step_done(plan)
        return self._commit(plan, result)

    def _commit(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        outputs = []
        for request_id, (start, entries) in result.prompt_logprobs.items():
            self._record_prompt_logprobs(self.requests[request_id], start, entries)
        for request_id, token_id in result.sampled.items():
            request = self.requests[request_id]
            request.token_ids.append(token_id)
            self._record_logprobs(request, token_id, result.logprobs.get(request_id))
            status = self._check_stop(request, token_id)
            if status is not None:
                self.scheduler.finish(request, status)
            outputs.append(self._output(request, [token_id]))
            if status is not None:
                del self.requests[request_id]
                del self._detokenizers[request_id]
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        detok = self._detokenizers[request.request_id]
        past_min = request.num_output_tokens >= params.min_tokens
        stop_string = detok.add_token(token_id, check_stop=past_min)
        if past_min:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                request.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        finished = request.status.finished
        detok = self._detokenizers[request.request_id]
        completion = CompletionOutput(
            index=0, text=detok.text, token_ids=request.output_token_ids,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=request.logprobs, finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, request.prompt_logprobs,
                             [completion], finished, request.num_cached_tokens,
                             delta_text=detok.take_delta(finished), delta_token_ids=new_token_ids)

    def _record_logprobs(self, request: Request, token_id: int, entries: dict | None) -> None:
        if request.logprobs is None or entries is None:
            return
        self._decode_entries(entries)
        request.logprobs.append(entries)
        request.cumulative_logprob += entries[token_id].logprob

    def _record_prompt_logprobs(self, request: Request, start: int, entries: list[dict]) -> None:
        assert request.prompt_logprobs is not None
        for offset, entry in enumerate(entries):
            if start + offset == len(request.prompt_logprobs):  # skip positions recorded before a preemption
                self._decode_entries(entry)
                request.prompt_logprobs.append(entry)

    def _decode_entries(self, entries: dict) -> None:
        if self.tokenizer is not None:
            for token_id, entry in entries.items():
                entry.decoded_token = self.tokenizer.convert_ids_to_tokens(token_id)

    # -- set-up helpers ----------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompt_token_ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, token_ids: Sequence[Any]) -> list[int]:
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.model.arch.vocab_size
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is not an integer in [0, {vocab})")
        return list(token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                             f"(at least one token must be left to generate)")
        total = min(self.max_model_len, len(token_ids) + (params.max_tokens or self.max_model_len))
        if self.kv.num_pages_for(total) > self.pool.num_pages:
            raise ValueError(f"the request needs up to {total} tokens of KV cache, more than the whole pool holds "
                             f"({self.pool.num_pages * self.kv.tokens_per_page})")
        vocab = self.model.arch.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")

    def _max_model_len(self) -> int:
        arch = self.model.arch
        limit = self.config.scheduler.max_model_len or arch.max_position_embeddings
        if self.config.scheduler.max_model_len and limit > arch.max_position_embeddings:
            raise ValueError(f"max_model_len {limit} exceeds the model's max_position_embeddings "
                             f"{arch.max_position_embeddings}")
        if arch.sliding_window and arch.sliding_window < limit:
            logger.warning("sliding-window attention is not implemented; max_model_len capped to the window %d",
                           arch.sliding_window)
            limit = arch.sliding_window
        return limit

    def _num_pages(self, layout: KVLayout, device: torch.device) -> int:
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * self.config.cache.gpu_memory_utilization)
            else:
                needed = self.max_model_len * self.config.scheduler.max_num_seqs * layout.bytes_per_token
                budget = min(CacheConfig.CPU_DEFAULT_KV_BYTES, needed)
        num_pages = budget // layout.page_bytes
        if num_pages * layout.tokens_per_page < min(self.max_model_len, 1):
            raise ValueError("the KV cache budget is too small for a single token")
        return max(num_pages, 1)

    def _eos_token_ids(self) -> list[int]:
        ids = list(self.model.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return ids
