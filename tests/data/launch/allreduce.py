"""A rank of a launch test: join the world as the trainer does (init_distributed), all-reduce, report.

Writes $SPADE_TEST_OUT/rank<R>.json, with its arguments (the config and overrides a trainer would get). With SPADE_TEST_WAIT_USR1 set, each rank
first waits (up to 60 s) for SIGUSR1, as a trainer told to checkpoint before the time limit would.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from spade_mega.megatron.parallel import init_distributed

out = Path(os.environ["SPADE_TEST_OUT"])
got_signal = []
if os.environ.get("SPADE_TEST_WAIT_USR1"):
    signal.signal(signal.SIGUSR1, lambda signum, frame: got_signal.append(signum))
world = init_distributed()
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
if os.environ.get("SPADE_TEST_WAIT_USR1"):
    (out / f"ready{rank}").touch()
    deadline = time.monotonic() + 60
    while not got_signal and time.monotonic() < deadline:
        time.sleep(0.05)
record = {"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]), "sum": total.item(),
          "master_addr": os.environ["MASTER_ADDR"], "master_port": int(os.environ["MASTER_PORT"]),
          "engine_urls": os.environ.get("SPADE_ENGINE_URLS"), "usr1": bool(got_signal), "args": sys.argv[1:]}
(out / f"rank{rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
