"""The LLM solvability check, validation's last step, in the mode ``validation.solvability.mode`` names.

SPADE validates tool-use environments with "an LLM solvability check". Two ways of asking the policy are offered, each
judging every program of a regeneration in one batch on the rollout's engine:

``play`` (:class:`PlayedSolvability`): the policy *plays* each program with the designer's hint, exactly as a hint
play does, and a program fewer than ``min_wins`` of whose ``attempts`` are won is refused as unsolvable. A win is
evidence a reading cannot fake, a program the policy cannot win even when told how teaches the agent nothing until the
policy improves, and the episodes go through the same lockstep machinery as training (``rollout.agent``): every
attempt of every program in one batch, one engine call per turn, at most ``rollout.max_open_envs`` sandbox workers
open. A program that breaks while being played (its ``step()`` times out or raises on the model's actions) is refused
with that failure as the reason: training would hit it too.

``judge`` (:class:`JudgedSolvability`, the reference's ``EnvironmentValidator``): the policy *reads* each program's
source and answers a boxed yes or no (:func:`parse_verdict`), one request per program, all in one engine call. What a
reply without a verdict and a failed call decide is configured (``on_no_verdict``, ``on_error``; the reference
accepts the program in both cases). The reply is not trained on, as in the reference.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import replace
from typing import Optional, Sequence

from spade_mega.config.schema import SpadeConfig
from spade_mega.curriculum.rewards import won
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.envs.validate import Reason, SolvabilityCheck, SolvabilityVerdict
from spade_mega.inference.base import Engine, EngineError, GenerationRequest, SamplingParams
from spade_mega.rollout.agent import play_episodes
from spade_mega.rollout.chat import ChatTurns, decode, encode
from spade_mega.rollout.records import AgentEpisode, AgentPlay, RolloutStats
from spade_mega.rollout.sampling import derived_seed

log = logging.getLogger(__name__)


class PlayedSolvability:
    """A :data:`~spade_mega.envs.validate.SolvabilityCheck` that plays the programs with ``engine``.

    Attempt ``k`` of a program resets it with seed ``validation.seed + k`` (distinct instances) and samples at
    ``validation.solvability.temperature`` with a seed derived from the program's hash, so a program's verdict under
    given weights is reproducible. ``stats`` adds up the engine and sandbox time of every check, for metrics.
    """

    def __init__(self, engine: Engine, chat: ChatTurns, pool: SandboxPool, cfg: SpadeConfig) -> None:
        self.engine, self.chat, self.pool = engine, chat, pool
        self.check = cfg.validation.solvability
        self.seed = cfg.validation.seed
        # the attempts are hint plays, sampled at the check's temperature
        self.cfg = replace(cfg, rollout=replace(cfg.rollout, hint_temperature=self.check.temperature))
        self.stats = RolloutStats()

    def __call__(self, programs: Sequence[EnvProgram]) -> list[SolvabilityVerdict]:
        attempts = self.check.attempts
        plays = [AgentPlay(i, program, seed=self.seed + k, hinted=True,
                           sampling_seed=derived_seed(int(program.content_hash[:15], 16), k))
                 for i, program in enumerate(programs) for k in range(attempts)]
        batch = play_episodes(self.engine, self.chat, self.pool, self.cfg, plays)
        for name in RolloutStats.__dataclass_fields__:
            setattr(self.stats, name, getattr(self.stats, name) + getattr(batch.stats, name))
        by_program: list[list[AgentEpisode]] = [[] for _ in programs]
        for episode in batch.episodes:
            by_program[episode.env_id].append(episode)
        return [self._verdict(episodes) for episodes in by_program]

    def _verdict(self, episodes: list[AgentEpisode]) -> SolvabilityVerdict:
        wins = sum(won(ep.reward, self.cfg.rewards) for ep in episodes)
        cost = {"plays": float(len(episodes)), "wins": float(wins), "turns": float(sum(ep.turns for ep in episodes)),
                "generated_tokens": float(sum(ep.sequence.num_generated for ep in episodes)),
                # each turn's request carries the whole context before it, as RolloutStats counts prompt tokens
                "prompt_tokens": float(sum(start for ep in episodes for start, _ in ep.turn_spans))}
        for ep in episodes:
            if (fault := ep.program_fault) is not None:
                return SolvabilityVerdict(False, f"while the policy played it with the hint (seed {ep.seed}): "
                                                 f"{ep.failure_detail}", fault, cost)
        threshold, needed = self.cfg.rewards.win_threshold, self.check.min_wins
        best = max(ep.reward for ep in episodes)
        detail = (f"{wins} of {len(episodes)} attempts with the hint won (reward >= rewards.win_threshold "
                  f"{threshold:g}; best reward {best:g}); validation.solvability.min_wins is {needed}")
        return SolvabilityVerdict(wins >= needed, detail, Reason.UNSOLVABLE, cost)


# A box's opening; its content runs to the matching closing brace (nested braces allowed).
_BOX = re.compile(r"\\boxed\s*\{")
# LaTeX wrappers a model puts around a word in a box: \boxed{\text{yes}}, \boxed{\textbf{No}}, \boxed{\boxed{yes}}.
_WRAPPER = re.compile(r"^\\(?:boxed|text|textbf|textit|texttt|mathrm|mathbf|mbox)\s*\{(.*)\}$", re.DOTALL)
# Code in the reply is the model quoting the program, not judging it. As markdown (CommonMark) reads it: a fence opens
# on a line that starts with one (up to 3 spaces in; a backtick fence's info string holds no backtick) and closes on a
# line of the same character alone, at least as long, or runs to the end; an inline span closes at the next run of
# as many backticks on its line. A ``` inside a quoted line neither opens nor closes a block.
_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})")
_FENCE_CLOSE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t\r]*$")
_BACKTICKS = re.compile(r"`+")


def _without_inline_code(line: str) -> str:
    """``line`` with each inline code span (a backtick run to the next run as long) blanked, in one pass."""
    runs = [(m.start(), m.end()) for m in _BACKTICKS.finditer(line)]
    later: dict[int, list[int]] = {}  # run length -> indices of the runs of that length, last first
    for i in reversed(range(len(runs))):
        later.setdefault(runs[i][1] - runs[i][0], []).append(i)
    pieces, at, i = [], 0, 0
    while i < len(runs):
        start, end = runs[i]
        same = later[end - start]
        same.pop()  # this run
        if not same:  # no closing run: literal backticks
            i += 1
            continue
        close = same[-1]
        pieces += [line[at:start], " "]
        at = runs[close][1]
        for j in range(i + 1, close + 1):  # the runs inside the span and its closing run are spent
            later[runs[j][1] - runs[j][0]].pop()
        i = close + 1
    return "".join(pieces) + line[at:]
_VERDICTS = {"yes": True, "no": False}


def _boxes(text: str) -> list[str]:
    """The contents of the outermost ``\\boxed{...}`` of ``text``, in order; an unclosed box has none."""
    contents, at = [], 0
    while (match := _BOX.search(text, at)) is not None:
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            break
        contents.append(text[match.end():i - 1])
        at = i
    return contents


def _prose(reply: str, source: str) -> str:
    """``reply`` without its code (blocks and inline spans, each line kept as an empty one) and without the lines that
    are lines of the program's ``source`` (a quote that left its code block: the program talking, not the judge)."""
    quoted = {line.strip() for line in source.splitlines()} - {""}
    lines, fence = [], None
    for line in reply.split("\n"):
        if fence is not None:  # inside a block
            closing = _FENCE_CLOSE.match(line)
            if closing and closing[1][0] == fence[0] and len(closing[1]) >= len(fence):
                fence = None
            lines.append("")
        elif (opening := _FENCE_OPEN.match(line)) and not (opening[1][0] == "`" and "`" in line[opening.end():]):
            fence = opening[1]
            lines.append("")
        else:
            line = _without_inline_code(line)
            lines.append("" if line.strip() in quoted else line)
    return "\n".join(lines)


def parse_verdict(reply: str, source: str = "") -> Optional[bool]:
    """The judge's verdict in ``reply`` (the model's answer alone, never the prompt that quotes the program): True for
    ``\\boxed{yes}``, False for ``\\boxed{no}``, None when there is none to read. ``source`` is the judged program's.

    Strict where the reference (the first ``\\boxed{...}``, yes/y/true accepting and anything else refusing) guesses:
    only a box holding yes or no is a verdict (case, surrounding space, a final full stop and LaTeX wrappers such as
    ``\\text{}`` or a nested box do not matter; ``\\boxed{42}`` is no verdict); boxes inside code (the model quoting the
    program, read as markdown reads it), on a line of the program's ``source`` (a quote outside code) and inside the
    reasoning of a thinking model (before its last ``</think>`` outside code; an unclosed ``<think>`` means the answer
    never came) do not count; and a reply whose verdicts disagree has none. So the program, quoted verbatim in code or
    out of it, adds no verdict: at most it hides the model's (None, which ``on_no_verdict`` decides)."""
    reply = _prose(reply, source)
    if "</think>" in reply:
        reply = reply.rsplit("</think>", 1)[1]
    elif "<think>" in reply:
        return None
    found = set()
    for content in _boxes(reply):
        word = content.strip()
        while (wrapped := _WRAPPER.match(word)) is not None:
            word = wrapped.group(1).strip()
        word = word.rstrip(".").strip().lower()
        if word in _VERDICTS:
            found.add(_VERDICTS[word])
    return found.pop() if len(found) == 1 else None


class JudgedSolvability:
    """A :data:`~spade_mega.envs.validate.SolvabilityCheck` that asks ``engine`` to judge each program's source.

    One request per program, all in one ``engine.generate`` call, sampled at ``validation.solvability.temperature``
    with a seed derived from the program's hash (a verdict under given weights is reproducible), at most
    ``judge_max_tokens`` long and never past ``rollout.max_context_tokens``. A program whose prompt leaves no room for
    a reply, and every program of a call that raises :class:`EngineError`, get the ``on_error`` decision; a reply
    without a verdict gets ``on_no_verdict``. ``stats`` adds up the engine time and tokens of every check.
    """

    def __init__(self, engine: Engine, chat: ChatTurns, cfg: SpadeConfig) -> None:
        self.engine, self.chat = engine, chat
        self.check = cfg.validation.solvability
        self.context = cfg.rollout.max_context_tokens
        self.top_p = cfg.rollout.top_p
        self.stats = RolloutStats()
        # Thinking models' templates (DeepSeek-R1, Qwen3 Thinking-2507) open the reasoning in the generation prompt:
        # the reply is read as its continuation, so a reply cut off before its </think> holds no answer
        opening = chat.after_observation
        self.reasoning = "<think>" if opening.rfind("<think>") > opening.rfind("</think>") else ""

    def __call__(self, programs: Sequence[EnvProgram]) -> list[SolvabilityVerdict]:
        tokenizer = self.chat.tokenizer
        prompts = [tuple(encode(tokenizer, self.chat.builder.solvability_judge(p.source).text)) for p in programs]
        asked = [i for i, ids in enumerate(prompts) if len(ids) < self.context]
        requests = [GenerationRequest(prompts[i], SamplingParams(
            max_new_tokens=min(self.check.judge_max_tokens, self.context - len(prompts[i])),
            temperature=self.check.temperature, top_p=self.top_p, stop_token_ids=self.chat.stop_ids,
            seed=derived_seed(int(programs[i].content_hash[:15], 16), 0))) for i in asked]
        replies: dict[int, tuple[str, int]] = {}  # program -> (reply, generated tokens)
        failure = None
        if requests:
            started = time.perf_counter()
            try:
                generations = self.engine.generate(requests)
                if len(generations) != len(requests):
                    raise EngineError(f"the engine returned {len(generations)} completions for {len(requests)} "
                                      "requests")
            except EngineError as error:
                failure = f"the judge's engine call failed: {error}"
                generations = []
            self.stats.generation_s += time.perf_counter() - started
            self.stats.engine_calls += 1
            self.stats.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
            self.stats.generated_tokens += sum(len(g.output_ids) for g in generations)
            self.stats.sequences += len(generations)
            for i, generation in zip(asked, generations):
                ids = self.chat.content_ids(generation.output_ids, self.chat.finish_reason(generation))
                replies[i] = (decode(tokenizer, ids), len(generation.output_ids))
        # the program as written and as the prompt shows it (control tokens broken): the lines the model may quote
        shown = [f"{p.source}\n{self.chat.builder.untrusted(p.source)}" for p in programs]
        verdicts = [self._verdict(shown[i], prompts[i], replies.get(i), failure) for i in range(len(programs))]
        for key, setting in (("judge_no_verdict", "on_no_verdict"), ("judge_errors", "on_error")):
            count = sum(int(v.cost[key]) for v in verdicts)
            if count:  # the fallback decided these, not the judge
                log.warning("solvability judge: %d of %d program(s) %s (validation.solvability.%s: %s)", count,
                            len(programs), "got a reply without a verdict" if key == "judge_no_verdict"
                            else "could not be judged", setting, getattr(self.check, setting))
        return verdicts

    def _verdict(self, source: str, prompt: tuple[int, ...], answer: Optional[tuple[str, int]],
                 failure: Optional[str]) -> SolvabilityVerdict:
        cost = {"judged": 1.0, "prompt_tokens": 0.0, "generated_tokens": 0.0, "judge_yes": 0.0, "judge_no": 0.0,
                "judge_no_verdict": 0.0, "judge_errors": 0.0}
        if answer is None:
            cost["judge_errors"] = 1.0
            detail = failure or (f"the judge's prompt ({len(prompt)} tokens) leaves no room for a reply within "
                                 f"rollout.max_context_tokens ({self.context})")
            return self._fallback(self.check.on_error, detail, "on_error", cost)
        reply, generated = answer
        cost["prompt_tokens"], cost["generated_tokens"] = float(len(prompt)), float(generated)
        verdict = parse_verdict(self.reasoning + reply, source)
        quoted = _excerpt(reply)
        if verdict is None:
            cost["judge_no_verdict"] = 1.0
            return self._fallback(self.check.on_no_verdict, f"the judge's reply has no single \\boxed{{yes}} or "
                                  f"\\boxed{{no}}: {quoted}", "on_no_verdict", cost)
        cost["judge_yes" if verdict else "judge_no"] = 1.0
        return SolvabilityVerdict(verdict, f"the judge answered {'yes' if verdict else 'no'}: {quoted}",
                                  Reason.UNSOLVABLE, cost)

    @staticmethod
    def _fallback(decision: str, detail: str, setting: str, cost: dict[str, float]) -> SolvabilityVerdict:
        return SolvabilityVerdict(decision == "accept", f"{detail} (validation.solvability.{setting}: {decision})",
                                  Reason.UNSOLVABLE, cost)


def _excerpt(reply: str, chars: int = 300) -> str:
    """The end of a reply (where the verdict is asked for), on one line."""
    text = " ".join(reply.split())
    return repr(text if len(text) <= chars else "..." + text[-chars:])


def solvability_check(engine: Engine, chat: ChatTurns, pool: SandboxPool, cfg: SpadeConfig) -> SolvabilityCheck:
    """The check ``validation.solvability.mode`` names, on the rollout's engine (and, to play, its sandbox pool)."""
    if cfg.validation.solvability.mode == "judge":
        return JudgedSolvability(engine, chat, cfg)
    return PlayedSolvability(engine, chat, pool, cfg)
