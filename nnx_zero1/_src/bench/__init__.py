"""Private: the benchmark behind ``python -m nnx_zero1.bench``."""
