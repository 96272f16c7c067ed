"""`python -m workbench.bench` (also under torchrun: `torchrun --nproc-per-node 2 -m workbench.bench`)."""

import sys

from workbench.bench.cli import main
from workbench.cli_common import closed_pipe

try:
    sys.exit(main())
except BrokenPipeError:  # `python -m workbench.bench --history-table | head`: stop quietly, as `workbench` does
    sys.exit(closed_pipe())
