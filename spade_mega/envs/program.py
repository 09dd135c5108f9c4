"""The environment program record: what the designer writes, and what travels beside it.

The source is an untrusted Python module (the contract is in docs/environments.md). It is only ever *text* in the
trainer process; it runs only inside sandbox workers. The hint and the skill are parsed from the designer output
and travel beside the source, never inside it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EnvProgram:
    """An executable environment program plus its privileged hint and skill tag.

    ``provenance`` records where it came from (``{"origin": "library", "name": ...}`` or ``{"origin": "designer",
    "iteration": ..., "document_id": ..., "policy_version": ...}``); it is not part of the identity.
    """

    source: str
    hint: str
    skill: str
    provenance: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def content_hash(self) -> str:
        """Stable identity: sha256 over source, hint and skill (provenance excluded, so re-proposals dedupe)."""
        payload = json.dumps({"source": self.source, "hint": self.hint, "skill": self.skill}, sort_keys=True)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "hint": self.hint, "skill": self.skill,
                "provenance": dict(self.provenance), "content_hash": self.content_hash}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EnvProgram":
        return cls(source=data["source"], hint=data["hint"], skill=data["skill"],
                   provenance=dict(data.get("provenance") or {}))
