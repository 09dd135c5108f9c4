"""The SPADE self-play loop: environment regeneration, agent plays, delayed designer rewards, GRPO steps, weight sync,
and checkpoints that resume exactly. ``spade-mega train CONFIG`` runs it; :func:`run` is the same from Python."""

from spade_mega.selfplay.loop import RunSummary, SelfPlay, run
from spade_mega.selfplay.state import ActiveEnv, CheckpointStore, LoopState, ResumeError, derive_seed

__all__ = ["ActiveEnv", "CheckpointStore", "LoopState", "ResumeError", "RunSummary", "SelfPlay", "derive_seed", "run"]
