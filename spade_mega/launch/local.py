"""``spade-mega launch local``: the trainer's ranks as processes of this machine, under torchrun (gloo on CPU).

The number of processes defaults to the fewest the parallel layout fits (TP x PP x CP and ETP x EP x PP both divide
it), so ``parallel.tensor=2`` on a laptop starts two ranks without further flags.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Optional, Sequence

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import SpadeConfig
from spade_mega.launch.plan import minimal_world_size
from spade_mega.launch.sbatch import TRAIN_PROGRAM
from spade_mega.megatron.parallel import resolve_layout


def local_command(cfg: SpadeConfig, config_path: str, overrides: Sequence[str], nproc: Optional[int] = None,
                  script: Optional[str] = None) -> list[str]:
    """torchrun for ``nproc`` ranks (default: the layout's minimum) running the trainer, or ``script`` instead;
    either gets the config file and the overrides as its arguments. The layout is checked first."""
    nproc = minimal_world_size(cfg) if nproc is None else nproc
    if nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {nproc}")
    try:
        resolve_layout(cfg.parallel, cfg.model, nproc)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"{exc.message} (launch local runs {nproc} processes; the layout needs a "
                                    f"multiple of {minimal_world_size(cfg)})") from None
    program = [script] if script else list(TRAIN_PROGRAM)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *program, config_path, *overrides]


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_local(command: Sequence[str]) -> int:
    """Run torchrun until it exits; its exit status is the command's (128 + N when a signal N ended it, as a shell
    reports it).

    torchrun runs in a session of its own and gets each SIGINT, SIGTERM or SIGHUP sent to this process exactly once:
    it hands them to every rank and gives them its shutdown grace, and this process waits for all of it. A ``kill``
    of the launcher left torchrun and the ranks training on without it, and Ctrl-C (subprocess.call) killed torchrun
    with SIGKILL a quarter of a second later, leaving the ranks it had not yet stopped behind."""
    proc = subprocess.Popen(list(command), start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - status if status < 0 else status
