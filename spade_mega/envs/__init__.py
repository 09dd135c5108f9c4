"""Executable environments: the program contract, the sandbox pool, validation, the reference library."""

from spade_mega.envs.program import EnvProgram

__all__ = ["EnvProgram"]
