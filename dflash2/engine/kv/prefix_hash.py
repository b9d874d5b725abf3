"""Chained content hashes of full pages: page i's hash covers every token up to the end of page i."""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def page_hash(parent: bytes | None, token_ids: Sequence[int], namespace: str) -> bytes:
    """Hash of one full page given its parent's hash; `namespace` keeps models apart in one pool."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else namespace.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_hashes(token_ids: Sequence[int], tokens_per_page: int, namespace: str,
                 num_pages: int | None = None) -> list[bytes]:
    """Hashes of the first `num_pages` full pages of `token_ids` (all full pages by default)."""
    full = len(token_ids) // tokens_per_page
    count = full if num_pages is None else min(full, num_pages)
    hashes: list[bytes] = []
    parent = None
    for i in range(count):
        parent = page_hash(parent, token_ids[i * tokens_per_page:(i + 1) * tokens_per_page], namespace)
        hashes.append(parent)
    return hashes
