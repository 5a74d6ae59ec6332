"""modelpar_kernels: fused ops, one file per op (Triton kernel, autograd.Function, torch reference)."""
