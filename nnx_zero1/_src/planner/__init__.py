"""The planner's machinery (``python -m nnx_zero1.plan``): private, one idea per module."""
