"""QuantConfig: bits per tensor group, overridable per layer, plus the KV cache dtype and how it was made.

Stored as the `quantization` section of a converted model's config.json:

    "quantization": {"format": "dflash2", "version": 1,
                     "embed_quant": 8, "qkv_quant": 4, "o_proj_quant": 8, "ffn_quant": 6, "lm_head_quant": 8,
                     "experts_quant": 4, "group_size": null, "layers": {"0": {"ffn": 8}},
                     "kv_quant": "int8", "kv_cache_dtype": "int8",
                     "calibration": {"method": "activation-weighted clipping", "dataset": "x.jsonl", "samples": 64},
                     "source": "/path/to/unquantized", "formats": {...every tensor's resolved format...}}

`experts` is the stacked experts of a mixture-of-experts layer (null: as `ffn`); a MoE layer's router gate is
always kept in 16 bits, and Qwen2-MoE's shared expert is an `ffn` tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash2.quantization.formats import WEIGHT_BITS, WeightFormat, resolve_group_size

GROUPS = ("embed", "qkv", "o_proj", "ffn", "lm_head")
EXPERTS = "experts"  # the experts of a MoE layer: their own bits, or (None) ffn's
LAYER_GROUPS = ("qkv", "o_proj", "ffn", EXPERTS)
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8", "int8", "int4")
FORMAT_NAME = "dflash2"
VERSION = 1

_BIT_ALIASES = {"16": 16, "bf16": 16, "fp16": 16, "bfloat16": 16, "float16": 16, "8": 8, "int8": 8,
                "6": 6, "int6": 6, "4": 4, "int4": 4}
_KV_ALIASES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "16": "bf16", "fp16": "fp16",
               "float16": "fp16", "fp8": "fp8", "fp8_e4m3": "fp8", "8": "int8", "int8": "int8",
               "4": "int4", "int4": "int4"}


def parse_bits(value: Any, what: str = "weight quantization") -> int:
    """'8', 'int8', 8 -> 8. ValueError naming the supported widths otherwise."""
    key = str(value).strip().lower()
    if key not in _BIT_ALIASES:
        raise ValueError(f"unsupported bit width {value!r} for {what}; supported: "
                         f"{', '.join(map(str, WEIGHT_BITS))} (or int8, int6, int4, bf16)")
    return _BIT_ALIASES[key]


def parse_kv_dtype(value: Any, what: str = "KV cache dtype") -> str:
    key = str(value).strip().lower()
    if key not in _KV_ALIASES:
        raise ValueError(f"unsupported {what} {value!r}; supported: {', '.join(KV_CACHE_DTYPES)}")
    return _KV_ALIASES[key]


@dataclass(frozen=True)
class QuantConfig:
    """Bits for each tensor group; `layer_overrides` maps a layer index to {group: bits} for qkv/o_proj/ffn/experts."""

    embed: int = 16
    qkv: int = 16
    o_proj: int = 16
    ffn: int = 16
    lm_head: int = 16
    experts: int | None = None  # None: as ffn (in each layer)
    group_size: int | None = None  # None: 128, or the largest of 128/64/32 dividing the row
    layer_overrides: tuple[tuple[int, tuple[tuple[str, int], ...]], ...] = ()
    kv_cache_dtype: str = "auto"
    calibration: dict[str, Any] | None = field(default=None, compare=False)
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for group in GROUPS:
            parse_bits(getattr(self, group), f"{group}")
        if self.experts is not None:
            parse_bits(self.experts, EXPERTS)
        for layer, overrides in self.layer_overrides:
            for group, bits in overrides:
                if group not in LAYER_GROUPS:
                    raise ValueError(f"layer {layer}: {group!r} cannot be set per layer; per-layer groups: "
                                     f"{', '.join(LAYER_GROUPS)}")
                parse_bits(bits, f"layer {layer} {group}")
        parse_kv_dtype(self.kv_cache_dtype)

    # -- lookups -----------------------------------------------------------------------------------
    def bits_for(self, group: str, layer_index: int | None = None) -> int:
        if group not in GROUPS and group != EXPERTS:
            raise ValueError(f"unknown tensor group {group!r}; groups: {', '.join(GROUPS + (EXPERTS,))}")
        for layer, overrides in self.layer_overrides:
            if layer == layer_index:
                for name, bits in overrides:
                    if name == group:
                        return bits
        if group == EXPERTS and self.experts is None:
            return self.bits_for("ffn", layer_index)
        return getattr(self, group)

    def format_for(self, group: str, in_features: int, layer_index: int | None = None) -> WeightFormat:
        bits = self.bits_for(group, layer_index)
        if bits not in (4, 6):
            return WeightFormat(bits)
        where = group if layer_index is None else f"layer {layer_index} {group}"
        return WeightFormat(bits, resolve_group_size(in_features, self.group_size, where))

    def describe(self) -> str:
        """'embed 8, qkv 4, o_proj 4, ffn 4, lm_head 8 bits' (+ the int4/int6 group size, the layers that differ)."""
        text = ", ".join(f"{group} {getattr(self, group)}" for group in GROUPS)
        text += (f", experts {self.experts}" if self.experts is not None else "") + " bits"
        if self.group_size is not None and any(bits in (4, 6) for bits in self.all_bits()):
            text += f" (groups of {self.group_size})"
        if self.layer_overrides:
            text += f"; {len(self.layer_overrides)} layers differ"
        return text

    @property
    def is_quantized(self) -> bool:
        return any(bits != 16 for bits in self.all_bits())

    def all_bits(self) -> list[int]:
        return ([getattr(self, g) for g in GROUPS] + ([self.experts] if self.experts is not None else [])
                + [b for _, o in self.layer_overrides for _, b in o])

    # -- config.json -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": FORMAT_NAME, "version": VERSION}
        data.update({f"{group}_quant": getattr(self, group) for group in GROUPS})
        data["experts_quant"] = self.experts
        data["group_size"] = self.group_size
        data["layers"] = {str(layer): dict(overrides) for layer, overrides in self.layer_overrides}
        data["kv_quant"] = self.kv_cache_dtype
        data["kv_cache_dtype"] = self.kv_cache_dtype
        data["calibration"] = self.calibration
        data["source"] = self.source
        return data

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "QuantConfig":
        if data.get("format", FORMAT_NAME) != FORMAT_NAME:
            raise ValueError(f"unsupported quantization format {data.get('format')!r}; this engine reads "
                             f"{FORMAT_NAME!r} (written by `dflash2 convert`)")
        bits = {group: parse_bits(data.get(f"{group}_quant", 16), f"{group}_quant") for group in GROUPS}
        experts = data.get("experts_quant")
        bits[EXPERTS] = None if experts is None else parse_bits(experts, "experts_quant")
        layers = data.get("layers") or {}
        overrides = tuple(sorted(
            (int(layer), tuple(sorted((g, parse_bits(b, f"layer {layer} {g}")) for g, b in groups.items())))
            for layer, groups in layers.items()))
        kv = data.get("kv_cache_dtype", data.get("kv_quant", "auto"))
        return QuantConfig(**bits, group_size=data.get("group_size"), layer_overrides=overrides,
                           kv_cache_dtype=parse_kv_dtype(kv), calibration=data.get("calibration"),
                           source=data.get("source"))

    @staticmethod
    def build(base_bits: int = 16, group_bits: dict[str, int | None] | None = None,
              layer_overrides: dict[int, dict[str, int]] | None = None, **kwargs: Any) -> "QuantConfig":
        """Every group at `base_bits` unless named in `group_bits` (the experts: as ffn unless named); overrides as
        {layer: {group: bits}}."""
        bits: dict[str, int | None] = {group: base_bits for group in GROUPS}
        for group, value in (group_bits or {}).items():
            if group not in bits and group != EXPERTS:
                raise ValueError(f"unknown tensor group {group!r}; groups: {', '.join(GROUPS + (EXPERTS,))}")
            if value is not None:
                bits[group] = value
        overrides = tuple(sorted((layer, tuple(sorted(groups.items())))
                                 for layer, groups in (layer_overrides or {}).items()))
        return QuantConfig(**bits, layer_overrides=overrides, **kwargs)


def parse_layer_override(spec: str) -> dict[int, dict[str, int]]:
    """'0-3:ffn=8,qkv=8' -> {0: {'ffn': 8, 'qkv': 8}, 1: ..., 3: ...}."""
    try:
        layers_part, groups_part = spec.split(":", 1)
        if "-" in layers_part:
            first, last = (int(x) for x in layers_part.split("-", 1))
        else:
            first = last = int(layers_part)
        groups = {}
        for item in groups_part.split(","):
            name, bits = item.split("=", 1)
            groups[name.strip()] = parse_bits(bits, f"--layer-quant {spec}")
    except ValueError as e:
        if "bit width" in str(e):
            raise
        raise ValueError(f"bad --layer-quant {spec!r}; expected LAYERS:GROUP=BITS[,GROUP=BITS], "
                         f"e.g. 0-3:ffn=8,qkv=8,experts=4") from None
    for name in groups:
        if name not in LAYER_GROUPS:
            raise ValueError(f"--layer-quant {spec!r}: {name!r} cannot be set per layer; "
                             f"use one of {', '.join(LAYER_GROUPS)}")
    if first < 0 or last < first:
        raise ValueError(f"--layer-quant {spec!r}: bad layer range")
    return {layer: dict(groups) for layer in range(first, last + 1)}
