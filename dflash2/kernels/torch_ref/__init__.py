"""Plain PyTorch kernels: the CPU path and the reference that device kernels are tested against."""
