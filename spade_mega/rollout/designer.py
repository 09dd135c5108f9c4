"""Designer generation: prompts for a batch of slots, one engine call, parsing, then sandbox validation.

Each slot (skill, grounding document, memory's seeds and negatives) becomes one designer prompt, trimmed to the budget
by ``PromptBuilder.designer``; every completion becomes a :class:`DesignerOutcome` whose sequence is the prompt
(mask 0) plus the generated ids (mask 1). Parsing never runs the program; the parsed programs are validated together
by ``Validator.validate_many``, which runs them only in sandbox workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.parsing import DesignerParseError, parse_designer_output
from spade_mega.curriculum.prompts import PromptError
from spade_mega.envs.validate import Validator
from spade_mega.inference.base import Engine, EngineError, Generation, GenerationRequest
from spade_mega.rollout.chat import ChatTurns, decode, encode
from spade_mega.rollout.records import DesignerOutcome, DesignerSlot, RolloutStats, TokenSequence
from spade_mega.rollout.sampling import sampling


@dataclass
class DesignerBatch:
    """The outcomes of ``generate_designs``, in slot order, and where the time went."""

    outcomes: list[DesignerOutcome]
    stats: RolloutStats = field(default_factory=RolloutStats)

    @property
    def valid(self) -> list[DesignerOutcome]:
        return [outcome for outcome in self.outcomes if outcome.valid]


def generate_designs(engine: Engine, chat: ChatTurns, validator: Validator, cfg: SpadeConfig,
                     slots: Sequence[DesignerSlot], iteration: Optional[int] = None) -> DesignerBatch:
    """One designer output per slot, parsed and validated. ``iteration`` goes into each program's provenance."""
    rollout, builder, tokenizer = cfg.rollout, chat.builder, chat.tokenizer
    stats = RolloutStats()
    prompts = [builder.designer(slot.skill, slot.document, slot.seeds, slot.negatives) for slot in slots]
    requests = []
    for slot, prompt in zip(slots, prompts):
        ids = encode(tokenizer, prompt.text)
        budget = min(rollout.max_designer_tokens, rollout.max_context_tokens - len(ids))
        if budget < 1:  # the builder trims to its budget; only a builder without one gets here
            raise PromptError(f"the designer prompt for skill {slot.skill!r} has {len(ids)} tokens, leaving no room "
                              f"within rollout.max_context_tokens ({rollout.max_context_tokens})")
        requests.append(GenerationRequest(tuple(ids), sampling(rollout, budget, hinted=False,
                                                               seed=slot.sampling_seed, stop_ids=chat.stop_ids)))
    started = time.perf_counter()
    generations = engine.generate(requests) if requests else []
    stats.generation_s = time.perf_counter() - started
    if len(generations) != len(requests):
        raise EngineError(f"the engine returned {len(generations)} completions for {len(requests)} requests")
    stats.engine_calls = int(bool(requests))
    stats.prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    stats.generated_tokens = sum(len(g.output_ids) for g in generations)
    stats.sequences = len(generations)

    outcomes = [designer_outcome(chat, slot, gen, prompt.dropped, iteration)
                for slot, prompt, gen in zip(slots, prompts, generations)]
    started = time.perf_counter()
    validate_outcomes(validator, outcomes)
    stats.validation_s = time.perf_counter() - started
    return DesignerBatch(outcomes, stats)


def designer_outcome(chat: ChatTurns, slot: DesignerSlot, generation: Generation,
                     prompt_dropped: Optional[dict[str, int]] = None, iteration: Optional[int] = None) -> DesignerOutcome:
    """The outcome of one completion of ``slot``'s prompt: its sequence, text and parsed program (or parse error);
    ``validation`` is left for :func:`validate_outcomes`."""
    sequence = TokenSequence()
    sequence.append_context(generation.prompt_ids)
    sequence.append_generated(generation.output_ids, generation.logprobs, generation.weight_version)
    finish = chat.finish_reason(generation)
    text = decode(chat.tokenizer, chat.content_ids(generation.output_ids, finish))
    outcome = DesignerOutcome(
        skill=slot.skill, document_id=slot.document.id if slot.document is not None else None,
        seed_env_ids=tuple(record.id for record in slot.seeds),
        negative_env_ids=tuple(record.id for record in slot.negatives),
        sequence=sequence, text=text, finish_reason=finish, prompt_dropped=dict(prompt_dropped or {}))
    provenance: dict[str, Any] = {"origin": "designer", "iteration": iteration, "document_id": outcome.document_id,
                                  "policy_version": generation.weight_version}
    try:
        outcome.program = parse_designer_output(text, chat.builder.skills.names, expected_skill=slot.skill,
                                                finished=finish == "stop", provenance=provenance)
    except DesignerParseError as error:
        outcome.parse_error, outcome.parse_detail = error.reason, error.detail
    return outcome


def validate_outcomes(validator: Validator, outcomes: Sequence[DesignerOutcome]) -> None:
    """Validate every parsed program together (in sandbox workers) and attach each report to its outcome."""
    parsed = [outcome for outcome in outcomes if outcome.program is not None]
    reports = validator.validate_many([outcome.program for outcome in parsed]) if parsed else []
    for outcome, report in zip(parsed, reports):
        outcome.validation = report
