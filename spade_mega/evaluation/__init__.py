"""Held-out evaluation: question-answer suites (maths, multiple choice) scored from the model's final answer, and
library environments played by the agent; run by the self-play loop every ``eval.interval`` rollouts and by
``spade-mega eval`` on a checkpoint (docs/evaluation.md).

    evaluator = Evaluator(cfg, engine, tokenizer, pool)
    results = evaluator.evaluate()              # [SuiteResult(name, kind, metrics, details), ...]
    log_metrics(results)                        # {"eval/aime25/accuracy": 0.3, ...}

Names are imported on first use (PEP 562): registering ``spade-mega eval`` must not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "datasets": ("QAItem", "builtin_arithmetic", "load_items", "prompt_text"),
    "runner": ("EvalError", "Evaluator", "SuiteResult", "eval_seed", "log_metrics", "selected"),
    "scoring": ("SCORERS", "Scorer", "choice_letter", "final_answer", "normalise", "pass_at_k"),
}
_MODULE = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE[name]}"), name)
