"""QuantConfig: per-group bits, per-layer overrides, the config.json round trip, flag parsing."""
from __future__ import annotations

import pytest

from dflash2.quantization.config import QuantConfig, parse_bits, parse_kv_dtype, parse_layer_override
from dflash2.quantization.formats import WeightFormat


def mixed() -> QuantConfig:
    return QuantConfig.build(8, {"qkv": 4, "ffn": 6}, {0: {"ffn": 8}, 29: {"qkv": 8, "o_proj": 16}},
                             kv_cache_dtype="int8", calibration={"method": "x"}, source="/src")


def test_groups_and_per_layer_overrides():
    config = mixed()
    assert config.bits_for("embed") == 8 and config.bits_for("o_proj", 3) == 8
    assert config.bits_for("qkv", 3) == 4 and config.bits_for("qkv", 29) == 8
    assert config.bits_for("ffn", 0) == 8 and config.bits_for("ffn", 1) == 6
    assert config.bits_for("o_proj", 29) == 16
    assert config.format_for("qkv", 576, 3) == WeightFormat(4, 64)
    assert config.format_for("ffn", 1536, 2) == WeightFormat(6, 128)
    assert config.format_for("embed", 576) == WeightFormat(8)


def test_config_json_round_trip_records_every_choice():
    config = mixed()
    data = config.to_dict()
    for key in ("embed_quant", "qkv_quant", "o_proj_quant", "ffn_quant", "lm_head_quant", "kv_quant",
                "kv_cache_dtype", "group_size", "layers", "calibration", "source"):
        assert key in data
    assert data["layers"] == {"0": {"ffn": 8}, "29": {"o_proj": 16, "qkv": 8}}
    back = QuantConfig.from_dict(data)
    assert back == config and back.calibration == {"method": "x"} and back.source == "/src"


def test_explicit_group_size_applies_and_must_divide():
    config = QuantConfig.build(4, group_size=32)
    assert config.format_for("qkv", 576, 0) == WeightFormat(4, 32)
    with pytest.raises(ValueError, match="group size 128 does not divide the row of 576 weights \\(layer 0 qkv\\)"):
        QuantConfig.build(4, group_size=128).format_for("qkv", 576, 0)


def test_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match="unsupported bit width '3'"):
        parse_bits("3")
    with pytest.raises(ValueError, match="unsupported bit width"):
        QuantConfig(ffn=5)
    with pytest.raises(ValueError, match="unsupported KV cache dtype 'int2'"):
        parse_kv_dtype("int2")
    with pytest.raises(ValueError, match="'embed' cannot be set per layer"):
        QuantConfig.build(8, layer_overrides={0: {"embed": 4}})
    with pytest.raises(ValueError, match="unsupported quantization format"):
        QuantConfig.from_dict({"format": "gptq"})


def test_aliases_and_layer_override_specs():
    assert [parse_bits(v) for v in ("int8", "8", 8, "int6", "int4", "bf16", "16")] == [8, 8, 8, 6, 4, 16, 16]
    assert parse_kv_dtype("8") == "int8" and parse_kv_dtype("fp8") == "fp8"
    assert parse_layer_override("0-2:ffn=8,qkv=int8") == {i: {"ffn": 8, "qkv": 8} for i in range(3)}
    assert parse_layer_override("5:o_proj=4") == {5: {"o_proj": 4}}
    with pytest.raises(ValueError, match="expected LAYERS:GROUP=BITS"):
        parse_layer_override("ffn=8")
    with pytest.raises(ValueError, match="'lm_head' cannot be set per layer"):
        parse_layer_override("1:lm_head=8")
