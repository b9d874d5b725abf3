"""Frozen configuration objects.

`ModelArchConfig` is the architecture of one Llama-family network, built from a Hugging Face config.json,
from GGUF metadata, or from a named preset. The engine-level configs (cache, scheduler) come from the user.
Numbers found at run time (pages that fit, tokens per page) live in objects built from these, never here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-frequency divisors given directly (GGUF `rope_freqs.weight`); overrides the llama3 formula.
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelArchConfig:
    """The numbers that define one decoder-only Llama-family network, dense or mixture-of-experts.

    A mixture-of-experts network (num_experts > 0) replaces the MLP of its sparse layers (`is_sparse_layer`) by
    a router over num_experts experts of moe_intermediate_size, num_experts_per_tok of them per token: softmax
    over all experts in float32, top-k, renormalized when norm_topk_prob; the weights kept in float32
    (router_weights_float: Mixtral) or cast to the model dtype (the others), as the reference computes them.
    Qwen2-MoE adds a shared expert (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate(x)).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on per-head q and k
    qk_norm_whole: bool = False  # OLMoE: RMSNorm on the whole q and k projections (all heads at once)
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    num_experts: int = 0  # 0: a dense network
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_weights_float: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in, if it says

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling {self.rope.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                             f"({self.num_experts})")
        if (self.architecture in MOE_ARCHITECTURES) != (self.num_experts > 0):
            raise ValueError(f"{self.architecture} with num_experts {self.num_experts}: a mixture-of-experts "
                             f"architecture has experts and a dense one none")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % max(1, self.decoder_sparse_step) == 0)

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> "ModelArchConfig":
        """Build from a Hugging Face config.json dict (transformers 4 or 5 spelling)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        qkv_bias = cfg.get("qkv_bias", cfg.get("attention_bias"))
        if qkv_bias is None:  # Qwen2 and Qwen2-MoE checkpoints do not say: their q/k/v have biases
            qkv_bias = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        return ModelArchConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(qkv_bias),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            qk_norm_whole=arch == "OlmoeForCausalLM",
            clip_qkv=cfg.get("clip_qkv"),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if num_experts
            else 0,
            norm_topk_prob=arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob", False)),
            router_weights_float=arch == "MixtralForCausalLM",
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch == "Qwen2MoeForCausalLM" else 0,
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            sliding_window=sliding if arch != "Qwen3ForCausalLM" or cfg.get("use_sliding_window") else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    def replace(self, **changes: Any) -> "ModelArchConfig":
        return dataclasses.replace(self, **changes)

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes one token's K and V take across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def _arch_from_model_type(model_type: str | None) -> str:
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_MODEL_TYPE_TO_ARCH))}"
    )


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool. Pages are sized in bytes; each model maps how many tokens fit in one."""

    page_bytes: int = 1 << 20
    kv_cache_memory_bytes: int | None = None  # None: derived (CPU default below, GPU from utilization)
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # auto (a converted checkpoint's choice, else the model dtype), bf16, fp16,
    # fp32, fp8, int8, int4 (engine/kv/layout.py)
    kv_layout: str = "head_major"  # order inside a page: head_major or token_major (for measuring)
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0  # host memory (pinned on a GPU) for paused requests' KV and the L2 tier
    l3_cache_path: str | None = None  # a directory for the disk (L3) tier; None: no disk tier
    l3_cache_size_bytes: int | None = None  # None: L3_DEFAULT_FREE_SHARE of the free space there
    l3_flush_timeout_s: float = 10.0  # closing writes the pages on the device and in host memory down, this long

    CPU_DEFAULT_KV_BYTES = 1 << 30
    L3_DEFAULT_FREE_SHARE = 0.5

    def __post_init__(self) -> None:
        from dflash2.engine.kv.layout import kv_dtype_name

        if self.kv_cache_dtype != "auto":
            kv_dtype_name(self.kv_cache_dtype)  # ValueError naming the supported dtypes
        if self.kv_layout not in ("head_major", "token_major"):
            raise ValueError(f"kv_layout must be head_major or token_major, got {self.kv_layout!r}")
        if self.l3_cache_path is not None and not self.swap_space_bytes:
            raise ValueError("the disk (L3) KV cache reads and writes through host memory: give swap space too "
                             "(--swap-space, in GiB)")
        if self.l3_cache_size_bytes is not None and self.l3_cache_size_bytes <= 0:
            raise ValueError(f"the L3 cache size must be > 0, got {self.l3_cache_size_bytes} bytes")


@dataclass(frozen=True)
class SchedulerConfig:
    # None: chosen by device (DeviceDefaults below), logged at startup; a value given always wins
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefill_chunk_size: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    preemption_threshold: int = 1  # a waiting request pauses running ones at least this much less urgent
    priority_aging_seconds: float | None = None  # waiting this long outranks any newer request
    # While a request of the top priority present waits or has prompt left, the prefill chunks of requests
    # it outranks by preemption_threshold share at most this many tokens a step (None: no cap), so the
    # urgent request's steps stay short.
    max_outranked_prefill_tokens: int | None = 64

    def with_device_defaults(self, device_type: str, device_memory_bytes: int = 0) -> "SchedulerConfig":
        """This config with every size left None chosen for the device (a new object; this one is frozen)."""
        defaults = DeviceDefaults.for_device(device_type, device_memory_bytes)
        return dataclasses.replace(self, **{name: getattr(defaults, name) for name in DeviceDefaults.FIELDS
                                            if getattr(self, name) is None})

    @property
    def sizes_chosen(self) -> bool:
        return all(getattr(self, name) is not None for name in DeviceDefaults.FIELDS)

    def __post_init__(self) -> None:
        if self.max_outranked_prefill_tokens is not None and self.max_outranked_prefill_tokens < 0:
            raise ValueError(f"max_outranked_prefill_tokens must be >= 0, got {self.max_outranked_prefill_tokens}")
        if self.preemption_threshold < 1:
            raise ValueError(f"preemption_threshold must be >= 1, got {self.preemption_threshold}")
        if self.priority_aging_seconds is not None and self.priority_aging_seconds <= 0:
            raise ValueError(f"priority_aging_seconds must be > 0, got {self.priority_aging_seconds}")
        for name in DeviceDefaults.FIELDS:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DeviceDefaults:
    """The batch sizes a device gets when the user names none. A CPU runs a few requests at a time well; a
    large GPU needs hundreds in flight and long steps to stay busy (W7 on one H100, llama-3-8b: 4,710 output
    tok/s at 64 / 2048 / 512, 8,678 at 512 / 8192 / 512, 10,364 at 1024 / 8192 / 512 with no preemption;
    benchmarks/RESULTS.md). As vLLM does, the size follows the device's memory."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int

    FIELDS = ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
    LARGE_GPU_BYTES = 70 << 30  # H100 / H200 / A100-80GB class

    @staticmethod
    def for_device(device_type: str, device_memory_bytes: int = 0) -> "DeviceDefaults":
        if device_type != "cuda":
            return DeviceDefaults(64, 2048, 512)
        if device_memory_bytes >= DeviceDefaults.LARGE_GPU_BYTES:
            return DeviceDefaults(1024, 8192, 512)
        return DeviceDefaults(256, 4096, 512)
