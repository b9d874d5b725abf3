"""LLM: the offline API in vLLM's shape.

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

Several models on one KV pool: `LLM(models={"small": None, "int8": "/path/to/convert-output"})` (a name to a path,
None for the bundled model; or a list of ModelSpec / dicts with per-model options), then
`llm.generate(prompts, params, model="int8")`; `load_model` and `unload_model` change the set while it runs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dflash2.config import CacheConfig, SchedulerConfig
from dflash2.engine.admission import PromptInput
from dflash2.engine.config import EngineConfig
from dflash2.engine.engine import Engine
from dflash2.engine.parallel_sampling import merge_samples, sample_params
from dflash2.engine.served_model import ModelSpec
from dflash2.parallel.config import ParallelConfig
from dflash2.request import RequestOutput
from dflash2.sampling_params import SamplingParams
from dflash2.units import parse_bytes

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, load_format: str = "auto",
                 dtype: str = "auto", device: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 prefill_chunk_size: int | None = None,
                 kv_cache_dtype: str = "auto", kv_layout: str = "head_major",
                 kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.9, page_bytes: int = 1 << 20,
                 enable_prefix_caching: bool = True, attention_backend: str = "auto", enforce_eager: bool = False,
                 overlap: bool | None = None, swap_space: float | int | str = 0, preemption_threshold: int = 1,
                 priority_aging_seconds: float | None = None, low_priority_values_first: bool = False,
                 max_outranked_prefill_tokens: int | None = 64,
                 cuda_graph_max_prefill_tokens: int = 2048, stream_interval: int = 1,
                 models: dict[str, str | None] | Sequence[ModelSpec | dict] | None = None,
                 max_model_skip_steps: int = 8, l3_cache_path: str | None = None,
                 l3_cache_size: int | str | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 ray_address: str | None = None) -> None:
        """`swap_space`: pinned host memory for paused requests' KV, in GiB as a number (vLLM's unit) or a
        size string such as "512MiB"; it is also the host tier (L2) of the prefix cache. `l3_cache_path`: a
        directory for the disk tier (L3; needs swap space), `l3_cache_size` bounding it (bytes or "64GiB"; None:
        half the free space there). `max_num_seqs`, `max_num_batched_tokens`, `prefill_chunk_size`: None
        chooses them by device (config.DeviceDefaults). `models`: several models on one pool instead of
        `model` (see the module docstring); the other arguments are every model's defaults.
        `tensor_parallel_size`, `pipeline_parallel_size`: split the model over that many ranks (processes of this
        host, or Ray actors: `distributed_executor_backend` "mp" or "ray", `ray_address`); docs/PARALLEL.md."""
        config = EngineConfig(
            model=model, tokenizer=tokenizer, load_format=load_format, dtype=dtype, device=device, seed=seed,
            attention_backend=attention_backend, enforce_eager=enforce_eager, overlap=overlap,
            cuda_graph_max_prefill_tokens=cuda_graph_max_prefill_tokens,
            low_priority_values_first=low_priority_values_first, stream_interval=stream_interval,
            models=_model_specs(models), max_model_skip_steps=max_model_skip_steps,
            parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend,
                                    ray_address),
            cache=CacheConfig(page_bytes=page_bytes, kv_cache_dtype=kv_cache_dtype, kv_layout=kv_layout,
                              kv_cache_memory_bytes=parse_bytes(kv_cache_memory),
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching,
                              swap_space_bytes=_swap_bytes(swap_space), l3_cache_path=l3_cache_path,
                              l3_cache_size_bytes=parse_bytes(l3_cache_size)),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      prefill_chunk_size=prefill_chunk_size, max_model_len=max_model_len,
                                      preemption_threshold=preemption_threshold,
                                      priority_aging_seconds=priority_aging_seconds,
                                      max_outranked_prefill_tokens=max_outranked_prefill_tokens),
        )
        self.engine = Engine(config)

    def close(self) -> None:
        """Free the engine's device and host memory now (the page pool, CUDA graphs, pinned buffers, weights);
        also on `with LLM(...) as llm:` exit; dropping the last reference to the engine does the same."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self, model: str | None = None) -> Any:
        return self.engine.served(model).tokenizer

    @property
    def model_names(self) -> list[str]:
        return list(self.engine.models)

    def load_model(self, model: str | None, name: str | None = None, **options: Any) -> str:
        """Load another model onto the pool (options: ModelSpec's fields); returns its name."""
        return self.engine.load_model(ModelSpec(model=model, name=name, **options)).name

    def unload_model(self, name: str, force: bool = False) -> None:
        self.engine.unload_model(name, force)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, model: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion on `model` (None: the only one loaded); outputs come back in the
        order of the prompts.

        All prompts are validated before any runs, so a bad one raises ValueError and nothing is queued. A prompt
        whose params ask for n samples (or best_of) gets one output holding n completions.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts), SamplingParams(), "sampling_params")
        # only the last output of each request is kept: the engine need not build the others
        params = [dataclasses.replace(p, output_kind="final_only") for p in params]
        priorities = _per_prompt(priority, len(prompts), 0, "priority")
        request_ids: list[str] = []
        samples_of: list[list[str]] = []  # per prompt: its samples' request ids
        try:
            for prompt, param, prio in zip(prompts, params, priorities):
                ids: list[str] = []
                for sample in sample_params(param):
                    ids.append(self.engine.add_request(prompt, sample, prio, model=model,
                                                       shares_prompt_with=ids[0] if ids else None).request_id)
                    request_ids.append(ids[-1])
                samples_of.append(ids)
        except ValueError:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        finals = dict(zip(request_ids, self._run(request_ids)))
        return [finals[ids[0]] if len(ids) == 1 else merge_samples(ids[0], [finals[i] for i in ids], param)
                for ids, param in zip(samples_of, params)]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, model: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, model) for c in conversations]
        return self.generate([{"prompt_token_ids": ids} for ids in prompts], sampling_params, model=model)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            model: str | None = None) -> list[int]:
        tokenizer = self.get_tokenizer(model)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        failures: list[tuple[str, str]] = []
        while self.engine.has_unfinished():  # past the last output too: an overlapped step may be in flight
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    final[output.request_id] = output
            failures += [f for f in self.engine.take_failures() if f[0] in wanted]
        if failures:
            raise RuntimeError("; ".join(f"request {request_id} failed: {reason}" for request_id, reason in failures))
        return [final[r] for r in request_ids]


def _model_specs(models: dict[str, str | None] | Sequence[ModelSpec | dict] | None) -> tuple[ModelSpec, ...]:
    if models is None:
        return ()
    if isinstance(models, dict):
        return tuple(ModelSpec(model=path, name=name) for name, path in models.items())
    return tuple(m if isinstance(m, ModelSpec) else ModelSpec.from_dict(m) for m in models)


def _swap_bytes(swap_space: float | int | str) -> int:
    if isinstance(swap_space, str):
        return parse_bytes(swap_space) or 0
    if swap_space < 0:
        raise ValueError(f"swap_space must be >= 0, got {swap_space}")
    return int(swap_space * (1 << 30))


def _per_prompt(value: Any, count: int, default: Any, name: str) -> list[Any]:
    if value is None:
        return [default] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count
