"""Triton kernels, one module per family; imported only where triton is installed."""
