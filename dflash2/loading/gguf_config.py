"""A GGUF file's architecture: `general.architecture`, the `{arch}.*` and `tokenizer.ggml.*` metadata and the
tensor list -> ModelArchConfig, the same fields ModelArchConfig.from_hf_config gives the Hugging Face model.

    general.architecture   llama (Mixtral when it has experts) | qwen2 | qwen3 | qwen2moe | qwen3moe | olmoe
    {arch}.expert_count, expert_used_count                    -> num_experts, num_experts_per_tok
    {arch}.expert_feed_forward_length (else the experts' rows) -> moe_intermediate_size
    {arch}.expert_shared_feed_forward_length (else its rows)  -> shared_expert_intermediate_size (Qwen2-MoE)
    {arch}.attention.clamp_kqv                                -> clip_qkv (OLMoE)
    which layers have a router (blk.N.ffn_gate_inp)           -> mlp_only_layers (no key says it)
"""
from __future__ import annotations

from typing import Any

from gguf import ExpertGatingFuncType
from gguf.gguf_reader import ReaderTensor

from dflash2.config import MOE_ARCHITECTURES, ModelArchConfig, RopeConfig
from dflash2.loading.gguf_reader import SkimGGUFReader, string_array_length
from dflash2.loading.gguf_tensors import ROPE_FREQS_TENSOR, dequantize_tensor

# GGUF `general.architecture` -> Hugging Face architecture; a `llama` file with experts is Mixtral.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
_MIXTRAL = "MixtralForCausalLM"

# Whether the top-k routing weights are renormalized to sum to 1 when the file has no `{arch}.expert_weights_norm`
# (the converters of these four families write none): each family's fixed behaviour, as the Hugging Face reference
# computes it and llama.cpp hard-codes it per architecture. Mixtral always renormalizes; Qwen3-MoE checkpoints set
# norm_topk_prob (llama.cpp assumes it); Qwen2-MoE (Qwen1.5-MoE) and OLMoE checkpoints do not.
_RENORMALIZES_TOP_K = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}


def gguf_architecture(reader: SkimGGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def arch_config(reader: SkimGGUFReader, arch: str) -> ModelArchConfig:
    """Build the architecture from `{arch}.*` and `tokenizer.ggml.*` metadata and the tensor list."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    hidden_size = int(_required(reader, f"{arch}.embedding_length"))
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    num_layers = int(_required(reader, f"{arch}.block_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    moe = _moe_fields(reader, arch, tensors, num_layers)
    clip_qkv = _field(reader, f"{arch}.attention.clamp_kqv")
    return ModelArchConfig(
        architecture=_MIXTRAL if arch == "llama" and moe else GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden_size,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=int(head_dim or hidden_size // num_heads),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope_config(reader, arch),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch in ("qwen2", "qwen2moe") or any(name.endswith(".attn_q.bias") for name in tensors),
        qk_norm=arch in ("qwen3", "qwen3moe"),
        qk_norm_whole=arch == "olmoe",  # OLMoE's q/k norms span all heads (attn_q_norm is [heads * head_dim])
        clip_qkv=None if clip_qkv is None else float(clip_qkv),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader),
        **moe,
    )


def _moe_fields(reader: SkimGGUFReader, arch: str, tensors: dict[str, ReaderTensor], num_layers: int
                ) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelArchConfig; {} for a dense network (no `{arch}.expert_count`)."""
    num_experts = int(_field(reader, f"{arch}.expert_count") or 0)
    if not num_experts:
        if GGUF_ARCHITECTURES[arch] in MOE_ARCHITECTURES:
            raise ValueError(f"GGUF metadata key '{arch}.expert_count' is missing or 0: a {arch} file has experts")
        return {}
    if arch not in _RENORMALIZES_TOP_K:
        raise ValueError(f"GGUF architecture {arch!r} with {num_experts} experts: mixtures of experts are supported "
                         f"as {', '.join(_RENORMALIZES_TOP_K)} (llama: Mixtral)")
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating is not None and gating != ExpertGatingFuncType.SOFTMAX:
        raise ValueError(f"GGUF {arch}.expert_gating_func {gating}: only softmax routing is supported")
    # GGUF has no key for which layers are sparse (Qwen's mlp_only_layers / decoder_sparse_step): a layer with a
    # router is, the others are dense (spelled as mlp_only_layers, step 1).
    dense = tuple(layer for layer in range(num_layers) if f"blk.{layer}.ffn_gate_inp.weight" not in tensors)
    # Mixtral's and OLMoE's converters write no expert size: the experts' rows (= their feed_forward_length) give it
    expert_size = _field(reader, f"{arch}.expert_feed_forward_length") or _rows(tensors, "ffn_gate_exps")
    shared_size = _field(reader, f"{arch}.expert_shared_feed_forward_length") or _rows(tensors, "ffn_gate_shexp")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
        moe_intermediate_size=int(expert_size or _required(reader, f"{arch}.feed_forward_length")),
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", _RENORMALIZES_TOP_K[arch])),
        router_weights_float=arch == "llama",  # Mixtral's reference keeps the routing weights in float32
        shared_expert_intermediate_size=int(shared_size),
        mlp_only_layers=dense,
    )


def _rows(tensors: dict[str, ReaderTensor], kind: str) -> int:
    """The output rows of the first layer's `kind` tensor (GGUF lists dims innermost first); 0 if none has one."""
    for name, tensor in tensors.items():
        if name.startswith("blk.") and name.endswith(f".{kind}.weight"):
            return int(tensor.shape[1])
    return 0


def _rope_config(reader: SkimGGUFReader, arch: str) -> RopeConfig:
    """RoPE from `{arch}.rope.*`; a `rope_freqs.weight` tensor means llama3-style per-frequency divisors."""
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    original_context = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    freq_factors = _rope_freq_factors(reader)
    if freq_factors is not None:
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            freq_factors=freq_factors,
            original_max_position_embeddings=original_context,
        )
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    return RopeConfig(
        theta=theta,
        rope_type="default" if scaling_type == "none" else scaling_type,
        factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        original_max_position_embeddings=original_context,
    )


def _rope_freq_factors(reader: SkimGGUFReader) -> tuple[float, ...] | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return tuple(float(x) for x in dequantize_tensor(tensor).reshape(-1).tolist())
    return None


def _vocab_size(reader: SkimGGUFReader, arch: str) -> int:
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is not None:
        return int(vocab_size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"GGUF file has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    return string_array_length(tokens)


def _eos_token_ids(reader: SkimGGUFReader) -> tuple[int, ...]:
    # Chat GGUFs often mark the end-of-turn token separately (llama3's <|eot_id|>); both end generation.
    ids = (_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id"))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _field(reader: SkimGGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value, or `default` when the file lacks the key."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def _required(reader: SkimGGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return value
