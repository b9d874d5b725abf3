"""The GGUF native path: Q4_0/Q4_1 tensors as the engine's int4 (groups of 32), Q8_0 as int8, the rest float."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from dflash2.layers.quant_linear import QuantLinear
from dflash2.loading import model_loader
from dflash2.loading.gguf_loader import GGUFCheckpoint, q4_as_int4
from dflash2.loading.tokenizer import bundled_model_path
from dflash2.quantization.config import QuantConfig
from dflash2.quantization.formats import WeightFormat, dequantize
from tests.unit.test_gguf_loader import HIDDEN, NUM_HEADS, NUM_KV_HEADS, _llama_cpp_permute, _tensor_shapes, _write_gguf

INT4_G32 = WeightFormat(4, 32)


def _reader_tensor(values: np.ndarray, qtype: QType) -> SimpleNamespace:
    """What q4_as_int4 reads of a GGUFReader tensor: GGUF's shape order (columns first), the type, the blocks."""
    return SimpleNamespace(shape=[values.shape[1], values.shape[0]], tensor_type=qtype,
                           data=gguf.quants.quantize(values, qtype))


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1], ids=lambda qtype: qtype.name)
def test_q4_blocks_become_the_same_int4_weights(qtype: QType) -> None:
    values = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    tensor = _reader_tensor(values, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype).copy())
    ours = dequantize(INT4_G32, q4_as_int4(tensor))
    if qtype == QType.Q4_0:  # zero 8 and the f16 scale, exactly as stored
        assert torch.equal(ours, reference)
    else:  # the zero point -m / d rounded to f16: off by at most |m| * 2^-11 a weight
        minimum = reference.view(48, 4, 32).amin(-1, keepdim=True).abs().expand(48, 4, 32).reshape(48, 128)
        assert bool(((ours - reference).abs() <= minimum * 2.0 ** -11 + 1e-6).all())


def test_q4_1_constant_and_near_constant_blocks() -> None:
    values = np.random.default_rng(1).standard_normal((16, 96)).astype(np.float32)
    values[0, :32] = 0.75  # d = 0
    values[1, 32:64] = 3000.0 + np.linspace(0, 1e-4, 32, dtype=np.float32)  # -m / d beyond f16's range
    values[2, 64:] = 0.0
    tensor = _reader_tensor(values, QType.Q4_1)
    reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, QType.Q4_1).copy())
    ours = dequantize(INT4_G32, q4_as_int4(tensor))
    assert bool(torch.isfinite(ours).all())
    assert torch.equal(ours[0, :32], reference[0, :32]) and torch.equal(ours[2, 64:], reference[2, 64:])
    assert (ours[1, 32:64] - reference[1, 32:64]).abs().max() <= 3000.0 * 2.0 ** -10
    assert (ours[3:] - reference[3:]).abs().max() < 1e-2


# -- a tiny llama GGUF whose layers differ -------------------------------------------------------------------
LAYER_TYPES = {  # layer 0, layer 1
    "attn_q": (QType.Q4_1, QType.Q8_0), "attn_k": (QType.Q4_0, QType.Q8_0), "attn_v": (QType.Q4_1, QType.Q8_0),
    "attn_output": (QType.Q4_1, QType.Q4_1), "ffn_gate": (QType.Q8_0, QType.Q4_1),
    "ffn_up": (QType.Q8_0, QType.Q4_1), "ffn_down": (QType.Q8_0, QType.Q6_K),
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(2)
    tensors = {}
    for name, shape in _tensor_shapes("llama", 16, with_output=False).items():
        values = rng.standard_normal(shape).astype(np.float32)
        kind = name.split(".")[-2]
        if len(shape) == 1:
            tensors[name] = (values, QType.F32)
            continue
        qtype = QType.Q8_0 if name == "token_embd.weight" else LAYER_TYPES[kind][int(name.split(".")[1])]
        heads = {"attn_q": NUM_HEADS, "attn_k": NUM_KV_HEADS}.get(kind)
        stored = _llama_cpp_permute(values, heads) if heads else values
        if qtype == QType.Q6_K:
            from tests.unit.test_gguf_loader import _random_k_blocks
            data = _random_k_blocks(rng, shape[0], shape[1], qtype)
        else:
            data = gguf.quants.quantize(stored, qtype)
        tensors[name] = (data, qtype)
    return _write_gguf(tmp_path_factory.mktemp("native") / "mixed.gguf", "llama", tensors)


def test_native_config_per_group_and_layer(mixed_gguf: str) -> None:
    config = GGUFCheckpoint(mixed_gguf).native_quant_config()
    assert config is not None and config.group_size == 32
    assert (config.embed, config.lm_head) == (8, 8)  # Q8_0, and the output projection is tied to it
    layers = [{group: config.bits_for(group, layer) for group in ("qkv", "o_proj", "ffn")} for layer in (0, 1)]
    assert layers == [{"qkv": 4, "o_proj": 4, "ffn": 8},  # Q4_0 + Q4_1 mixed in one group stay int4
                      {"qkv": 8, "o_proj": 4, "ffn": 16}]  # Q4_1 + Q6_K: no kernel for both, dequantized


def test_bundled_native_config() -> None:
    config = GGUFCheckpoint(bundled_model_path()).native_quant_config()
    assert config == QuantConfig(embed=8, qkv=4, o_proj=4, ffn=4, lm_head=8, group_size=32)


def test_float_only_file_has_no_native_config(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = {name: (rng.standard_normal(shape).astype(np.float32), QType.F32)
               for name, shape in _tensor_shapes("llama", 16, with_output=False).items()}
    assert GGUFCheckpoint(_write_gguf(tmp_path / "f32.gguf", "llama", tensors)).native_quant_config() is None


def test_native_model_holds_the_float_paths_weights(mixed_gguf: str) -> None:
    """Every quantized layer of the native load dequantizes to the float load's weight (rows in their fused
    places, q/k un-permuted): int4 to within the f16 zero point, int8 to within half a step of its row."""
    checkpoint = GGUFCheckpoint(mixed_gguf)
    quant = checkpoint.native_quant_config()
    arch, device = checkpoint.arch_config, torch.device("cpu")
    native = model_loader._build(arch, torch.float32, device, None, quant)
    native.load_weights(checkpoint.iter_weights(quant))
    model_loader.prepare_quantized(native, "auto", torch.float32, device)
    floats = model_loader._build(arch, torch.float32, device, None)
    floats.load_weights(checkpoint.iter_weights())
    float_weights = dict(floats.named_parameters())
    checked = set()
    for name, layer in native.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        weight = float_weights[f"{name}.weight"]
        ours = layer.dequantized()
        if layer.fmt.bits == 4:
            tolerance = weight.abs().max() * 2.0 ** -10
        elif layer.fmt.bits == 8:
            tolerance = layer.scales.float().max() * 0.51
        else:
            tolerance = weight.abs().max() * 2.0 ** -8  # bfloat16
        assert (ours - weight).abs().max() <= tolerance, name
        checked.add(layer.fmt.bits)
    assert checked == {4, 8, 16}
    tokens = torch.tensor([3, 17, 40, 9])
    assert torch.allclose(native.embed_tokens(tokens), floats.embed_tokens(tokens), atol=0.02)
