"""KV cache: page pool bookkeeping, prefix hashing, per-request page tables, device layouts."""
