"""Scoring the engine's current weights on held-out suites: question-answer items, or library environments played
by the agent in sandbox workers.

Evaluation leaves training as it was: every completion is sampled with its own seed, derived from ``run.seed``, the
suite and the item (or environment and episode), never from the loop's random state, and nothing is written to the
run's memory or buffers. The same weights give the same scores, whenever the evaluation runs.

QA metrics (``eval/<suite>/...``): ``accuracy`` (the mean over items of the share of right samples: avg@k),
``pass_at_<k>`` (pass@k, the unbiased estimator) for k = 2, 4, ... and ``samples``, ``response_tokens`` (mean
completion length) and ``truncated`` (the share that ran into ``max_response_tokens``). Env metrics: ``return``
(mean episode return), ``win_rate`` (the share of episodes won, as training counts a win:
``curriculum.rewards.win_rate``), ``turns`` and ``failed`` (the share of episodes a sandbox failure or context
overflow ended). Unlike training's rates, which leave out a play its program broke (``AgentEpisode.measured``: it
measures the program, and the designer is penalised for it), ``return`` and ``win_rate`` count it at the reward it
ended with (0 under ``rewards.truncated_episode: zero``): the library's programs are tested by their oracles, so a
break here is a timeout or a fault the agent's own action found, and every checkpoint is scored over the same
episodes; ``failed`` shows how many.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from spade_mega.config.errors import ConfigError
from spade_mega.config.schema import EvalSuiteConfig, SpadeConfig
from spade_mega.curriculum.parsing import strip_reasoning
from spade_mega.curriculum.prompts import PromptBuilder, render
from spade_mega.curriculum.rewards import win_rate
from spade_mega.envs import library
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.errors import SpadeError
from spade_mega.evaluation.code import extract_code, run_tests
from spade_mega.evaluation.datasets import QAItem, load_items, prompt_text
from spade_mega.evaluation.scoring import SCORERS, pass_at_k, pass_ks
from spade_mega.inference.base import Engine, GenerationRequest, SamplingParams
from spade_mega.monitor.progress import RunProgress
from spade_mega.rollout.agent import play_episodes
from spade_mega.rollout.chat import ChatTurns, decode, encode
from spade_mega.rollout.records import AgentPlay

CHUNK = 256  # requests per engine call: the progress bar moves between calls; engines batch within one


class EvalError(SpadeError):
    """An evaluation cannot run as configured (a prompt that leaves no room for the answer, no sandbox pool)."""


def eval_seed(seed: int, *parts: object) -> int:
    """The sampling or reset seed of one evaluation completion, from the run's seed and what it samples (suite,
    item, sample): stable across runs and resumes, below 2**32 so every engine accepts it."""
    digest = hashlib.blake2b(repr((int(seed), "eval") + parts).encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass
class SuiteResult:
    """One suite's metrics and, per item (QA) or environment (env), what was asked and answered."""

    name: str
    kind: str
    metrics: dict[str, float]
    details: list[dict[str, Any]] = field(default_factory=list)


def log_metrics(results: Sequence[SuiteResult]) -> dict[str, float]:
    """``eval/<suite>/<metric>`` values, for the run's metrics logger."""
    return {f"eval/{r.name}/{name}": value for r in results for name, value in r.metrics.items()}


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def selected(cfg: SpadeConfig, only: Optional[Sequence[str]] = None) -> list[tuple[int, EvalSuiteConfig]]:
    """The suites named in ``only`` (all when None) with their index in ``eval.suites``; an unknown name is a
    ConfigError listing the config's suites."""
    known = [s.name for s in cfg.eval.suites]
    unknown = [name for name in only or () if name not in known]
    if unknown:
        raise ConfigError("eval.suites", f"no suite named {', '.join(map(repr, unknown))}; the config has "
                                         f"{', '.join(known) or 'none'}")
    return [(i, s) for i, s in enumerate(cfg.eval.suites) if only is None or s.name in only]


class Evaluator:
    """The suites of ``cfg.eval`` (those named in ``only``, when given) for one engine. Datasets are read and
    environment names checked here, so a bad suite fails before any training."""

    def __init__(self, cfg: SpadeConfig, engine: Engine, tokenizer: Any, pool: Optional[SandboxPool] = None,
                 only: Optional[Sequence[str]] = None) -> None:
        self.cfg, self.engine, self.pool = cfg, engine, pool
        self.builder = PromptBuilder.from_config(cfg, tokenizer)
        self.chat = ChatTurns(self.builder)
        # thinking models' templates (DeepSeek-R1, Qwen3 Thinking-2507) open the reasoning in the generation prompt
        opening = self.chat.after_observation
        self.opens_reasoning = opening.rfind("<think>") > opening.rfind("</think>")
        self.suites = selected(cfg, only)
        self.items: dict[str, list[QAItem]] = {}
        self.prompts: dict[str, list[list[int]]] = {}  # per QA item: its prompt's ids
        self.programs: dict[str, list[tuple[str, EnvProgram]]] = {}
        for i, suite in self.suites:
            if cfg.rollout.engine == "vllm" and suite.top_p < 1.0 and suite.temperature > 0:
                raise ConfigError(f"eval.suites[{i}].top_p", f"{suite.top_p} < 1 is not supported by rollout.engine "
                                                             "vllm (see rollout.top_p); set it to 1.0")
            if suite.kind == "qa":
                self.items[suite.name] = load_items(suite, f"eval.suites[{i}]")
                self.prompts[suite.name] = [self._prompt_ids(suite, item) for item in self.items[suite.name]]
            else:
                self.programs[suite.name] = [(name, self._program(i, name)) for name in suite.environments]
        sandboxed = [s.name for _, s in self.suites if s.kind == "env" or s.scorer == "code"]
        if sandboxed and pool is None:
            raise EvalError(f"suites {', '.join(sandboxed)} run in sandbox workers (environments, code): pass a pool")

    def _prompt_ids(self, suite: EvalSuiteConfig, item: QAItem) -> list[int]:
        """The item's chat prompt; one that leaves no room for an answer is refused now, before any training."""
        tokenizer, context = self.builder.tokenizer, self.cfg.rollout.max_context_tokens
        messages = ([{"role": "system", "content": suite.system_prompt}] if suite.system_prompt else []) + \
            [{"role": "user", "content": self.builder.untrusted(prompt_text(suite, item))}]
        ids = encode(tokenizer, render(tokenizer, messages, **self.builder.template_kwargs))
        if len(ids) >= context:
            raise EvalError(f"suite {suite.name!r}, item {item.item_id}: the prompt has {len(ids)} tokens, "
                            f"rollout.max_context_tokens ({context}) leaves no room for an answer")
        return ids

    def _final(self, reply: str) -> str:
        """The reply after a thinking model's reasoning, where its answer is; "" when the reasoning never closed (cut
        off by max_response_tokens: a box in it is a guess, not an answer)."""
        answer, closed = strip_reasoning(reply)
        return answer if closed and (not self.opens_reasoning or "</think>" in reply) else ""

    @staticmethod
    def _program(i: int, name: str) -> EnvProgram:
        try:
            return library.render(name)
        except library.LibraryError as exc:
            raise ConfigError(f"eval.suites[{i}].environments", str(exc)) from None

    @property
    def units(self) -> int:
        """Completions (QA) and episodes (env) of one evaluation: the progress bar's total."""
        return sum(len(self.items[s.name]) * s.samples if s.kind == "qa" else len(s.environments) * s.episodes
                   for _, s in self.suites)

    def evaluate(self) -> list[SuiteResult]:
        """Every suite, in config order, under one progress bar (without a terminal: a line per tenth)."""
        logging = replace(self.cfg.logging, log_interval=max(1, self.units // 10))
        with RunProgress(self.units, "evaluation", cfg=logging, fields=[]) as bar:
            return [self._qa(suite, bar) if suite.kind == "qa" else self._env(suite, bar) for _, suite in self.suites]

    # --- question-answer suites ---------------------------------------------------------------------------------

    def _qa(self, suite: EvalSuiteConfig, bar: RunProgress) -> SuiteResult:
        tokenizer, seed = self.builder.tokenizer, self.cfg.run.seed
        context = self.cfg.rollout.max_context_tokens
        items = self.items[suite.name]
        requests = []
        for item, ids in zip(items, self.prompts[suite.name]):
            budget = min(suite.max_response_tokens, context - len(ids))
            requests += [GenerationRequest(tuple(ids), SamplingParams(
                budget, suite.temperature, suite.top_p, seed=eval_seed(seed, suite.name, item.item_id, k),
                stop_token_ids=self.chat.stop_ids)) for k in range(suite.samples)]
        generations = []
        for start in range(0, len(requests), CHUNK):
            chunk = requests[start:start + CHUNK]
            generations += self.engine.generate(chunk)
            bar.advance(len(chunk))
        n = suite.samples
        finishes = [self.chat.finish_reason(gen) for gen in generations]
        replies = [self._final(decode(tokenizer, self.chat.content_ids(gen.output_ids, finish)))
                   for gen, finish in zip(generations, finishes)]
        references = [item.answer for item in items for _ in range(n)]
        if suite.scorer == "code":
            assert self.pool is not None  # checked in __init__
            answers = [extract_code(reply) for reply in replies]
            tests = [[(case[0], case[1]) for case in json.loads(reference)] for reference in references]
            right = run_tests(self.pool, answers, tests, self.cfg.rollout.max_open_envs)
        else:
            scored = [SCORERS[suite.scorer](reply, reference) for reply, reference in zip(replies, references)]
            answers, right = [answer for answer, _ in scored], [ok for _, ok in scored]
        details, accuracy = [], []
        passes: dict[int, list[float]] = {k: [] for k in pass_ks(n)}
        for index, item in enumerate(items):
            correct = sum(right[index * n:(index + 1) * n])
            accuracy.append(correct / n)
            for k in passes:
                passes[k].append(pass_at_k(n, correct, k))
            reference = f"{len(json.loads(item.answer))} test cases" if suite.scorer == "code" else item.answer
            details.append({"id": item.item_id, "reference": reference, "answers": answers[index * n:(index + 1) * n],
                            "correct": correct})
        metrics = {"accuracy": _mean(accuracy), **{f"pass_at_{k}": _mean(v) for k, v in passes.items()},
                   "response_tokens": _mean([float(len(gen.output_ids)) for gen in generations]),
                   "truncated": _mean([float(finish == "length") for finish in finishes]),
                   "items": float(len(items))}
        return SuiteResult(suite.name, "qa", metrics, details)

    # --- environment suites -------------------------------------------------------------------------------------

    def _env(self, suite: EvalSuiteConfig, bar: RunProgress) -> SuiteResult:
        assert self.pool is not None  # checked in __init__
        cfg, seed = self.cfg, self.cfg.run.seed
        play_cfg = replace(cfg, rollout=replace(cfg.rollout, temperature=suite.temperature, top_p=suite.top_p,
                                                max_response_tokens=suite.max_response_tokens))
        plays = [AgentPlay(name, program, eval_seed(seed, suite.name, name, e, "reset"),
                           sampling_seed=eval_seed(seed, suite.name, name, e, "sample"))
                 for name, program in self.programs[suite.name] for e in range(suite.episodes)]
        episodes = play_episodes(self.engine, self.chat, self.pool, play_cfg, plays, progress=bar).episodes
        details = []
        for name, _ in self.programs[suite.name]:
            mine = [ep for ep in episodes if ep.env_id == name]
            details.append({"environment": name, "returns": [ep.reward for ep in mine],
                            "win_rate": win_rate([ep.reward for ep in mine], cfg.rewards),
                            "failures": [ep.failure.value for ep in mine if ep.failure is not None]})
        metrics = {"return": _mean([ep.reward for ep in episodes]),
                   "win_rate": win_rate([ep.reward for ep in episodes], cfg.rewards),
                   "turns": _mean([float(ep.turns) for ep in episodes]),
                   "failed": _mean([float(ep.failure is not None) for ep in episodes]),
                   "episodes": float(len(episodes))}
        return SuiteResult(suite.name, "env", metrics, details)
