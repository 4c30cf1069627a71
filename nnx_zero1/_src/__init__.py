"""Private: everything under ``nnx_zero1._src`` may change without notice.

The public names are ``nnx_zero1.__all__``, ``nnx_zero1.testing`` and the adapters' classes.
"""
