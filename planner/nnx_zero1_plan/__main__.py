"""``python -m nnx_zero1_plan``: the planner's command line (also ``python -m nnx_zero1.plan``)."""

import sys

from nnx_zero1_plan.cli import main

sys.exit(main())
