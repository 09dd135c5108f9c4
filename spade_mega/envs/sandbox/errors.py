"""What can go wrong when running an untrusted environment program, as types a caller can tell apart.

Every failure of a program (a call that raises, hangs, crashes its worker, breaks the contract, prints too much, or
sends bytes that are not a valid reply) is a :class:`SandboxError` subclass: the trainer catches them, counts them and
moves on. :class:`SandboxUnavailable` is different: the *machine* cannot provide the isolation the config asks for.
"""

from __future__ import annotations

from spade_mega.errors import SpadeError


class SandboxUnavailable(SpadeError, RuntimeError):
    """The requested isolation cannot be had here (missing bubblewrap or libseccomp, namespaces denied, pool closed)."""


class SandboxError(SpadeError):
    """A call into an environment program failed. ``output`` holds what the program printed during it (capped);
    ``detail`` is the message without context (what validation reports beside its reason code)."""

    def __init__(self, message: str, output: str = "", detail: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.output = output
        self.detail = message if detail is None else detail


class LoadError(SandboxError):
    """The program did not load: ``kind`` is syntax, load_error, no_env_class, multiple_env_classes or bad_max_turns."""

    def __init__(self, kind: str, message: str, output: str = "") -> None:
        super().__init__(f"the program did not load ({kind}): {message}", output, detail=message)
        self.kind = kind


class ProgramError(SandboxError):
    """reset() or step() raised an exception inside the program."""


class ContractViolation(SandboxError):
    """The program returned something the contract forbids (wrong types, a non-finite reward, non-plain data)."""


class NonFiniteReward(ContractViolation):
    """step() returned a NaN or infinite reward."""


class SandboxTimeout(SandboxError):
    """A call overran its deadline; the worker was killed."""


class SandboxCrash(SandboxError):
    """The worker process died during a call (segfault, os._exit, killed by a resource limit)."""


class OutputLimitExceeded(SandboxError):
    """The program printed more than the per-call output limit, or its reply exceeded the reply size limit."""


class ProtocolError(SandboxError):
    """The worker sent bytes that are not a well-formed reply to the request (a program writing into the pipe)."""
