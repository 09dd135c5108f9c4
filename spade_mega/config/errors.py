"""The one error type of the config layer: it names the full key path, so a user can find what to fix."""

from __future__ import annotations

from spade_mega.errors import SpadeError


class ConfigError(SpadeError, ValueError):
    """A configuration problem at ``path`` (dotted key, or a file name when the file itself is wrong)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)
