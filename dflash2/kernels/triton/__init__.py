"""Triton kernels (GPU; also run on the CPU under TRITON_INTERPRET=1 in tests)."""
