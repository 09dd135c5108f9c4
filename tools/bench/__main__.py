"""`python -m tools.bench NAME [ARGS...]`: run the benchmark module tools/bench/NAME.py (its ``main(argv)``)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.name.startswith("_"))
    if len(sys.argv) < 2 or sys.argv[1] not in names:
        print(f"usage: python -m tools.bench NAME [ARGS...]; NAME is one of: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"tools.bench.{sys.argv[1]}").main(sys.argv[2:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
