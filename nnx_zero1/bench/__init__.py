"""``python -m nnx_zero1.bench``: memory, time and collectives of plain vs Zero-1 training."""
