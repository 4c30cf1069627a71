"""``python -m nnx_zero1.bench.maxtext_arms [--dp 4] [--ga 4] [--steps 5] [--out DIR]``.

MaxText's own engine with its Zero-1 flag against ``Zero1MaxTextTrainingEngine``
(needs ``maxtext``, Python >= 3.12).
"""

from nnx_zero1._src.bench.maxtext_arms import main

if __name__ == "__main__":
  raise SystemExit(main())
