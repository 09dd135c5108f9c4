"""Base of every user-facing error: the CLI prints its message in one line and exits with status 2."""

from __future__ import annotations


class SpadeError(Exception):
    """An error caused by the user's input (config, file, request): the message says what is wrong and what to do."""
