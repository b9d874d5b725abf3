"""gguf's GGUFReader, but a metadata array (a vocabulary, its merges, its token types) is not split into items.

GGUFReader builds numpy views per item of an array: for the bundled model's 49,152 tokens, 48,900 merges and
49,152 token types that took 9.7 s of a 21 s `dflash2 generate` on the 2-core CPU. Here an array of numbers is
one part (its field's `contents()` is the whole list, as before; `contents(i)` is not kept) and an array of
strings is one byte span stepped over by the strings' lengths: the engine reads no string array (the tokenizer
comes from transformers, or its cache: tokenizer.py), so its `contents()` is empty; `string_array_length` gives
the count.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

_LENGTH = struct.Struct("<Q")


class SkimGGUFReader(GGUFReader):
    """A GGUFReader (memory-mapped, read-only) whose arrays of strings are not split into items."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        start = offs = orig_offs + 12
        numbers = self.gguf_scalar_to_np.get(GGUFValueType(item_type[0]))
        if numbers is not None:
            values = self._get(start, numbers, count[0])
            if len(values) != count[0]:
                raise ValueError(f"GGUF array at offset {orig_offs} runs past the end of the file")
            return 12 + int(values.nbytes), [item_type, count, values], [2], [GGUFValueType.ARRAY,
                                                                              GGUFValueType(item_type[0])]
        if item_type[0] != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data, end = memoryview(self.data), len(self.data)
        for _ in range(int(count[0])):
            if offs + 8 > end:
                break
            offs += 8 + _LENGTH.unpack_from(data, offs)[0]
        else:
            if offs <= end:
                return offs - orig_offs, [item_type, count, self.data[start:offs]], [], [GGUFValueType.ARRAY,
                                                                                           GGUFValueType.STRING]
        raise ValueError(f"GGUF string array at offset {orig_offs} runs past the end of the file")


def string_array_length(field: ReaderField) -> int:
    """The number of items of a SkimGGUFReader's array-of-strings field."""
    return int(field.parts[-2][0])
