"""Isolated, persistent workers that run untrusted environment programs (see pool.py for the model).

Isolation per worker: bubblewrap (read-only minimal root, every namespace unshared, die-with-parent, new session,
no capabilities, a non-root uid), a seccomp filter, rlimits, memory and pids cgroups where available, an empty
environment with a fixed PYTHONHASHSEED, captured and capped output, and msgpack frames over pipes.
"""

from spade_mega.envs.sandbox.errors import (ContractViolation, LoadError, NonFiniteReward, OutputLimitExceeded,
                                            ProgramError, ProtocolError, SandboxCrash, SandboxError, SandboxTimeout,
                                            SandboxUnavailable)
from spade_mega.envs.sandbox.isolation import IsolationReport
from spade_mega.envs.sandbox.pool import EnvHandle, SandboxPool, StepResult

__all__ = ["ContractViolation", "EnvHandle", "IsolationReport", "LoadError", "NonFiniteReward", "OutputLimitExceeded",
           "ProgramError", "ProtocolError", "SandboxCrash", "SandboxError", "SandboxPool", "SandboxTimeout",
           "SandboxUnavailable", "StepResult"]
