"""``python -m nnx_zero1.bench [--quick] [--out DIR] [--dp 2,4,8] [--ga 1,8] [--model NAME]``.

Device set-up happens inside ``main`` before jax starts a backend; see
``nnx_zero1._src.bench.devices`` for why that works although the parent package
has already imported jax.
"""

from nnx_zero1._src.bench.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
