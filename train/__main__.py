"""``torchrun --nproc-per-node=N -m torchship.train [FLAGS]``: one training rank."""

import sys

from .launch import rank_main

sys.exit(rank_main())
