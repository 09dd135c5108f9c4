"""One rollout's transcript: every designer output and agent episode as text a researcher reads, beside its reward,
advantage and whether it was trained on (written by :mod:`spade_mega.monitor.transcripts`).

Records (one per trajectory; ``kind`` tells them apart, ``id`` links them):

- ``episode`` (role agent): an agent play, hint plays included; the decoded prompt, then per turn the model's reply
  (as the rollout decoded it, without the stop token),
  the action sent to ``step()``, its step reward and the next observation; return (sum of step rewards, null where
  it overflows a float), the training
  reward (clipped, 0 for a truncated episode by default), advantage and ``trained`` (hint plays and episodes the
  program broke are played but never trained on: advantage null; ``step_skipped``: the optimizer step holding it
  was skipped, its gradients not finite, so it was not trained on either; ``filtered``: its group's rewards were all
  equal and ``rl.filter_zero_std_groups`` dropped it, advantage 0, not trained on); ``measured`` false for a play
  its program broke, which no return, win rate, regret or memory evaluation counts (its reward is what the episode
  held when the program failed).
- ``output`` (role designer): a designer output at its regeneration rollout: decoded prompt, reply, parsed program
  and hint, or the parse error, the validation verdict. It is trained later, when its delayed reward is released.
- ``reward`` (role designer): written in the rollout that releases a designer output's reward (``id`` is the
  output's): the reward, its parts (win rate, regret, plateau, or the penalty), why it was masked, the advantage,
  ``trained`` and ``step_skipped`` as for an episode.

Which sample an advantage belongs to is matched by the identity of its token list: a :class:`Trajectory` holds the
episode's (or the designer sample's) own list, so the advantage recorded is the one its TrainSample carries.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.rewards import episode_return
from spade_mega.monitor.transcripts import clip, transcript_path, write_rollout
from spade_mega.rl.delayed import DesignerSample, ReleasedDesignerSample
from spade_mega.rollout.chat import decode
from spade_mega.rollout.records import AgentEpisode, DesignerOutcome, DesignerSlot, TokenSequence
from spade_mega.selfplay.batch import Trajectory
from spade_mega.selfplay.state import ActiveEnv

log = logging.getLogger("spade_mega.selfplay")


def _tokens(sequence: TokenSequence, prompt: int) -> dict[str, int]:
    return {"prompt": prompt, "generated": sequence.num_generated, "total": len(sequence)}


class RolloutTranscript:
    """The records of rollout ``rollout``, collected as the loop goes (nothing is decoded when disabled)."""

    def __init__(self, cfg: SpadeConfig, rollout: int, tokenizer: Any) -> None:
        self.enabled = cfg.logging.transcripts
        self.limit = cfg.logging.transcript_max_chars
        self.delay = cfg.selfplay.designer_delay
        self.rollout, self.tokenizer = rollout, tokenizer
        self.records: list[dict[str, Any]] = []
        self._trainable: dict[int, dict[str, Any]] = {}  # id(token list) -> the record of that trajectory
        self._decoded: dict[tuple[int, ...], Optional[str]] = {}

    def _text(self, ids: Sequence[int]) -> Optional[str]:
        """``ids`` decoded and clipped; the plays of an environment share their prompt, decoded once."""
        key = tuple(ids)
        if key not in self._decoded:
            self._decoded[key] = clip(decode(self.tokenizer, ids), self.limit)
        return self._decoded[key]

    def designer_output(self, outcome: DesignerOutcome, sample: DesignerSample, slot: DesignerSlot) -> None:
        if not self.enabled:
            return
        seq, program, report = outcome.sequence, outcome.program, outcome.validation
        prompt = len(seq) - seq.num_generated
        self.records.append({
            "rollout": self.rollout, "role": "designer", "kind": "output", "id": sample.sample_id,
            "env_id": sample.env_id, "skill": outcome.skill, "group": outcome.skill, "hinted": False,
            "slot": sample.metadata.get("slot"), "seed": slot.sampling_seed, "document_id": outcome.document_id,
            "seed_env_ids": list(outcome.seed_env_ids), "negative_env_ids": list(outcome.negative_env_ids),
            "weight_version": seq.policy_version, "prompt": self._text(seq.token_ids[:prompt]),
            "reply": clip(outcome.text, self.limit), "program": clip(program.source, self.limit) if program else None,
            "hint": clip(program.hint, self.limit) if program else None,
            "parse_error": outcome.parse_error.value if outcome.parse_error else None,
            "parse_detail": clip(outcome.parse_detail, self.limit) or None,
            "validation": None if report is None else {
                "ok": report.ok, "reason": report.reason.value if report.reason else None,
                "detail": clip(report.detail, self.limit), "output": clip(report.output, self.limit),
                "class_name": report.class_name, "horizon": report.horizon},
            "valid": outcome.valid, "rejection": outcome.rejection, "failure": outcome.failure,
            "finish_reasons": [outcome.finish_reason], "prompt_dropped": dict(outcome.prompt_dropped),
            "tokens": _tokens(seq, prompt), "trained": False, "reward_rollout": self.rollout + self.delay})

    def episodes(self, environments: Sequence[ActiveEnv], episodes: Sequence[AgentEpisode]) -> None:
        """Every episode of the rollout; ``environments`` in the loop's order (``group`` env<i> is the i-th)."""
        if not self.enabled:
            return
        where = {env.env_id: (e, env) for e, env in enumerate(environments)}
        played: dict[tuple[str, bool], int] = {}
        for ep in episodes:
            e, env = where[ep.env_id]
            k = played[(ep.env_id, ep.hinted)] = played.get((ep.env_id, ep.hinted), -1) + 1
            seq = ep.sequence
            prompt = ep.turn_spans[0][0] if ep.turn_spans else len(seq)
            turns = []
            for t in range(len(ep.turn_spans)):
                turns.append({"reply": clip(ep.replies[t], self.limit) if t < len(ep.replies) else None,
                              "action": clip(ep.actions[t], self.limit) if t < len(ep.actions) else None,
                              "finish_reason": ep.finish_reasons[t] if t < len(ep.finish_reasons) else None,
                              "reward": ep.step_rewards[t] if t < len(ep.step_rewards) else None,
                              "observation": clip(ep.observations[t + 1], self.limit)
                              if t + 1 < len(ep.observations) else None})
            record = {
                "rollout": self.rollout, "role": "agent", "kind": "episode",
                "id": f"r{self.rollout}-env{e}-{'hint' if ep.hinted else 'play'}{k}", "env_id": ep.env_id,
                "env_origin": env.origin, "env_name": env.program.provenance.get("name"), "skill": ep.skill,
                "group": f"env{e}", "hinted": ep.hinted, "seed": ep.seed, "sampling_seed": ep.sampling_seed,
                "weight_version": seq.policy_version, "prompt": self._text(seq.token_ids[:prompt]), "turns": turns,
                "terminated": ep.terminated, "truncated": ep.truncated,
                "failure": ep.failure.value if ep.failure else None, "failure_detail": ep.failure_detail or None,
                "measured": ep.measured,
                "malformed_actions": ep.malformed_actions, "finish_reasons": list(ep.finish_reasons),
                "return": total if math.isfinite(total := episode_return(ep.step_rewards)) else None,
                "reward": ep.reward, "advantage": None, "trained": False, "step_skipped": False,
                "filtered": False, "tokens": _tokens(seq, prompt)}
            self.records.append(record)
            if ep.trainable:
                self._trainable[id(seq.token_ids)] = record

    def released(self, items: Sequence[ReleasedDesignerSample]) -> None:
        """The designer rewards released this rollout, linked to their outputs by ``id``."""
        if not self.enabled:
            return
        for item in items:
            s, reward = item.sample, item.reward
            record = {"rollout": self.rollout, "role": "designer", "kind": "reward", "id": s.sample_id,
                      "env_id": s.env_id, "skill": s.skill, "group": s.skill, "hinted": False,
                      "output_rollout": s.step, "weight_version": s.policy_version, "failure": s.failure,
                      "valid": s.metadata.get("valid"), "rejection": s.metadata.get("rejection"),
                      "reward": reward.value, "mask_reason": reward.mask_reason,
                      "components": dict(reward.components), "advantage": None, "trained": False,
                      "step_skipped": False,
                      "tokens": {"prompt": len(s.loss_mask) - sum(s.loss_mask), "generated": sum(s.loss_mask),
                                 "total": len(s.token_ids)}}
            self.records.append(record)
            self._trainable[id(s.token_ids)] = record

    def settle(self, trajectories: Sequence[Trajectory], advantages: torch.Tensor, updated: Sequence[bool]) -> None:
        """Each trajectory's training reward, advantage and whether it was trained on, into its record: a masked
        designer reward is not (advantage null), nor a filtered agent sample (``filtered``, advantage 0), nor a sample
        whose optimizer step was skipped (``step_skipped``: its gradients were not finite). ``updated[k]`` is whether
        the step of the k-th trajectory that trains (the k-th TrainSample) was applied."""
        if not self.enabled:
            return
        if sum(t.trains for t in trajectories) != len(updated):
            raise ValueError(f"{len(updated)} step outcomes for {sum(t.trains for t in trajectories)} trained samples")
        steps = iter(updated)
        for t, advantage in zip(trajectories, advantages.tolist()):
            record = self._trainable[id(t.token_ids)]
            applied = next(steps) if t.trains else False
            record.update(reward=t.reward, advantage=advantage if t.valid else None, trained=applied,
                          step_skipped=t.trains and not applied)
            if t.filtered:
                record["filtered"] = True

    def write(self, run_dir: Path) -> Optional[Path]:
        """The rollout's file; a transcript that cannot be written (disk full, folder not writable) is a warning:
        it is a record of the run, and the run goes on without it (the previous rollouts' files stay whole)."""
        if not self.enabled:
            return None
        try:
            return write_rollout(run_dir, self.rollout, self.records)
        except (OSError, ValueError) as exc:
            log.warning("rollout %d: transcript not written to %s (%s: %s); training goes on", self.rollout,
                        transcript_path(run_dir, self.rollout), type(exc).__name__, exc)
            return None
