"""Run under torchrun by test_distributed: one rank through `python -m train`'s entry point, then the names of
the threads still running in it once that returns (after destroy_process_group)."""

import json
import os
import sys
from pathlib import Path

from train.launch import rank_main

rc = rank_main(sys.argv[2:])
names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
Path(sys.argv[1], f"threads{os.environ['RANK']}.json").write_text(json.dumps(names))
sys.exit(rc)
