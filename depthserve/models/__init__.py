"""Model definitions, one module per mechanism, plain PyTorch."""
