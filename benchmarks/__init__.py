"""The benchmark harness: ``python -m benchmarks.bench`` (and ``python -m benchmarks.maxtext_arms``).

Run from the repository root of a source checkout; not part of the ``nnx-zero1`` wheel. It may
read ``nnx_zero1``'s private modules (it is the project's own tool); ``nnx_zero1`` never imports it.
"""
