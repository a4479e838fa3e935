"""A torchrun worker for ``tests/test_multinode.py``: join the group, then work for ARGV[1] seconds.

The long step stands for a rank folding its share of a large model between two collectives.
"""

from __future__ import annotations

import sys
import time

from ema_ckpt.dist import current_workers

workers = current_workers()
print(f"joined as worker {workers.rank}", flush=True)
workers.run(lambda: time.sleep(float(sys.argv[1])))
print("done", flush=True)
