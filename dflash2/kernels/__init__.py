"""Compute kernels: plain-torch references (`torch_ref/`, the CPU path) and device kernels, behind dispatch."""
