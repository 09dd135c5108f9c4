"""Start-up time of the ``spade-mega`` command: ``--help`` and ``COMMAND --help`` as a user types them.

    python -m tools.bench cli_startup [--repeats 7]

Each figure is the median wall time of fresh processes, against two baselines measured in the same run: the bare
interpreter (``python -c pass``, the floor) and ``python -c "import torch"``, what every invocation paid while command
registration imported torch (bridge.commands did, through spade_mega.bridge).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

SCRIPT = Path(sys.executable).with_name("spade-mega")


def median_s(argv: Sequence[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench cli_startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="fresh processes per figure (median)")
    args = parser.parse_args(list(argv))
    floor = median_s([sys.executable, "-c", "pass"], args.repeats)
    torch_s = median_s([sys.executable, "-c", "import torch"], args.repeats)
    print(f"baselines: python -c pass {floor:.3f} s, python -c 'import torch' {torch_s:.3f} s "
          f"(median of {args.repeats})")
    for command in (["--help"], ["train", "--help"], ["launch", "slurm", "--help"], ["convert", "to-hf", "--help"]):
        took = median_s([str(SCRIPT), *command], args.repeats)
        print(f"spade-mega {' '.join(command):<22} {took:.3f} s = {took / floor:.1f}x the bare interpreter, "
              f"{took / torch_s:.2f}x import torch")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
