"""`python -m workbench.bench` (also under torchrun: `torchrun --nproc-per-node 2 -m workbench.bench`)."""

import sys

from workbench.bench.cli import main

sys.exit(main())
