"""Held-out evaluation: scorers on real answer strings, pass@k against brute force, suite loading errors, the tiny
model scored for real through the hf engine (twice: the same numbers), an env suite played in real sandbox workers,
the loop's eval hook in a real `spade-mega train` run, and `spade-mega eval` on its checkpoint and on an HF folder."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sandbox_support import strict_missing

from spade_mega.cli import main
from spade_mega.config.errors import ConfigError
from spade_mega.config.loader import load_config
from spade_mega.config.schema import EvalSuiteConfig
from spade_mega.envs.sandbox import SandboxPool
from spade_mega.evaluation import EvalError, Evaluator, QAItem, load_items, log_metrics, pass_at_k, prompt_text
from spade_mega.evaluation.scoring import SCORERS, as_number, last_boxed, normalise
from spade_mega.inference import build_engine
from spade_mega.selfplay.loop import scores_logged
from spade_mega.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "configs" / "tiny_cpu.yaml"
SCRIPT = Path(sys.executable).with_name("spade-mega")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}
ISOLATION = [] if strict_missing() is None else ["sandbox.isolation=best-effort"]

# --- scorers ----------------------------------------------------------------------------------------------------

BOXED = [  # (model reply, reference, right?)
    ("Adding the cases gives 204 + 73 = 277, so the answer is $\\boxed{277}$.", "277", True),
    ("\\boxed{033}", "33", True),  # AIME answers are 000-999: leading zeros are formatting
    ("The count is \\boxed{1,024}.", "1024", True),
    ("so $m/n = \\boxed{\\dfrac{7}{12}}$", "7/12", True),
    ("\\boxed{\\frac{14}{24}}", "\\frac{7}{12}", True),  # equal as numbers
    ("\\boxed{0.50}", "1/2", True),
    ("\\boxed{2.0}", "2", True),
    ("\\boxed{\\text{(B) } 12 \\text{ cm}}", "(B) 12 cm", True),  # text compared after normalisation
    ("first \\boxed{5}, but wait: \\boxed{6}", "6", False),  # two different boxed answers: a hedge scores 0
    ("\\boxed{x^{2} + \\frac{1}{2}}", "x^{2}+\\frac{1}{2}", True),  # nested braces, spaces
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", True),
    ("Therefore.\nAnswer: 45", "45", True),
    ("Final answer: $-3$.", "-3", True),
    ("\\boxed{278}", "277", False),
    ("\\boxed{7/11}", "7/12", False),
    ("I think it is 277.", "277", False),  # no box, no Answer: line
    ("\\boxed{27", "27", False),  # never closed
    ("The roots are $\\boxed{1, 234}$", "1234", False),  # a list of two numbers, not one thousand-separated
    ("\\boxed{2, 500}", "2500", False),
    ("\\boxed{10,\\!000}", "10000", True),  # MATH's thousands separator
    ("\\boxed{1{,}000}", "1000", True),
    ("\\boxed 5", "5", True),  # the token after a brace-less box
    ("I will write \\boxed at the end. The set is {12}.", "12", False),  # a box without braces does not reach on
    # formatting around a number: percent, degrees, dollars, a unit, a variable, a Unicode minus, \frac12
    ("\\boxed{50\\%}", "50", True),
    ("\\boxed{50}", "50\\%", True),
    ("\\boxed{51\\%}", "50", False),
    ("\\boxed{30^\\circ}", "30", True),
    ("\\boxed{30^{\\circ}}", "30^\\circ", True),
    ("The total is \\boxed{\\$18.90}.", "18.9", True),
    ("\\boxed{5\\text{ cm}}", "5", True),
    ("\\boxed{5 \\mbox{cm}}", "5\\text{ cm}", True),
    ("\\boxed{5\\text{ cm}}", "5\\text{ m}", False),  # another unit: not the same length
    ("\\boxed{6\\text{ cm}}", "5", False),
    ("\\boxed{3\\mathrm{i}}", "3", False),  # the imaginary unit is no unit of measure
    ("Answer: $5\\text{ cm}$.", "5", True),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{x=5}", "-5", False),
    ("\\boxed{−5}", "-5", True),
    ("\\boxed{\\frac12}", "0.5", True),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", True),
    ("\\boxed{\\left[ -1, \\infty \\right)}", "[-1,\\infty)", True),  # intervals: as text
    ("\\boxed{(-1, \\infty)}", "[-1,\\infty)", False),
    ("A train leaves at 3 pm at 60 mph; another at 4 pm at 80 mph. So 60, 80, 3 and 4 matter.", "240", False),
    # a reference that is a worked solution (MATH's solution field) is its boxed answer
    ("\\boxed{\\frac{1}{2}}", "Half of the 6 balls are red, so the chance is $\\boxed{\\frac{1}{2}}$.", True),
    ("\\boxed{6}", "Half of the 6 balls are red, so the chance is $\\boxed{\\frac{1}{2}}$.", False),
]


@pytest.mark.parametrize("reply, reference, right", BOXED)
def test_boxed_scorer_reads_the_final_maths_answer(reply: str, reference: str, right: bool) -> None:
    assert SCORERS["boxed"](reply, reference)[1] is right


CHOICE = [
    ("Comparing the four options, the answer is (C).", "C", True),
    ("Answer: B", "(B)", True),
    ("\\boxed{D}", "D", True),
    ("A is tempting, but the answer is a subtle one... Final answer: (A)", "A", True),
    ("(B)", "B", True),
    ("Answer: B", "C", False),
    ("I cannot decide.", "A", False),
    ("**Answer: (B)**", "B", True),
    ("The answer is: **C**", "C", True),
    ("The correct option is D.", "D", True),
    ("Answer: A\n\nWhy not the others: option B is wrong, and choice C: too large.", "B", False),  # the answer wins
    ("Answer: A\n\nWhy not the others: option B is wrong, and choice C: too large.", "C", False),
    ("Option A is right, option B is wrong.", "B", False),  # a mention of an option is no answer
    ("The answer I reached after checking is B.", "I", False),  # the pronoun, not option I
    ("The answer is A or B.", "A", False),  # a hedge names no answer
    ("Answer: (A) and (C)", "A", False),
    ("Answer: C, because the others fail.", "C", True),
    # a box holding the option's label and its text
    ("\\boxed{\\textbf{(C)} 12}", "C", True),
    ("The answer is \\boxed{(C) 5.2 eV}", "C", True),
    ("\\boxed{C. 5.2 eV}", "C", True),
    ("\\boxed{C) 5.2 eV}", "C", True),
    ("\\boxed{(C) 5.2 eV}", "B", False),
    ("\\boxed{(A) 1.1 eV}, or rather \\boxed{(C) 5.2 eV}", "C", False),  # two letters: a hedge
    ("\\boxed{A cat}", "A", False),  # an article, not option A
    ("\\boxed{(A) or (B)}", "A", False),  # a box naming two options is a hedge, as "Answer: A or B" is
    ("\\boxed{(A), (C)}", "A", False),
    ("\\boxed{A) 1.1 eV \\text{ and } C) 5.2 eV}", "A", False),
]


@pytest.mark.parametrize("reply, reference, right", CHOICE)
def test_choice_scorer_reads_the_final_letter(reply: str, reference: str, right: bool) -> None:
    assert SCORERS["choice"](reply, reference)[1] is right


@pytest.mark.timeout(60)  # before: cubic in the run (1000 spaces 2 s, these 3000 ~1 min, 10000 ~40 min)
def test_choice_scorer_reads_a_reply_with_a_long_blank_run_at_once() -> None:
    """A degenerate reply: an answer phrase, then thousands of blanks and no letter. The phrase's three adjacent
    whitespace runs (after 'is', after ':', before the letter) were tried in every split of the run."""
    assert SCORERS["choice"]("The answer is" + " " * 3000 + "unclear.", "A") == (None, False)
    assert SCORERS["choice"]("The answer is:" + "\n" * 3000 + "**(C)**", "C") == ("C", True)


@pytest.mark.timeout(60)  # before: quadratic in the run (10k blanks 0.5 s, these 150k ~2 min)
def test_an_answer_line_after_a_long_blank_run_is_read_at_once() -> None:
    """The ``Answer: ...`` line of a reply without a box, in a degenerate reply with a long run of blanks: after
    'answer' (no colon follows) and inside the answer's line."""
    assert SCORERS["boxed"]("answer" + " " * 150_000 + "x", "1") == (None, False)
    assert SCORERS["exact"]("Answer: 5" + " " * 150_000 + "x \n", "5x")[1]
    assert SCORERS["boxed"]("Answer:\n\n  12  \nThat is all.", "12") == ("12", True)  # the line after the colon
    assert SCORERS["exact"]("Answer: 5\nFinal answer:   \n", "5") == (" ", False)  # an empty last answer: none


def test_exact_scorer_and_the_normalisation_pieces() -> None:
    assert SCORERS["exact"]("  Paris. ", "Paris")[1] and not SCORERS["exact"]("Lyon", "Paris")[1]
    assert SCORERS["exact"]("Answer: $x = 2$", "x=2")[1]
    assert not SCORERS["exact"]("\\boxed{2.0}", "2")[1]  # text, not numbers
    assert last_boxed("a \\boxed{\\frac{a}{\\sqrt{b}}} b") == "\\frac{a}{\\sqrt{b}}"
    assert normalise(" $\\text{12}\\,\\mathrm{cm}$. ") == "12cm"
    assert as_number("-1,234.50") == Fraction(-246900, 200) and as_number("3/0") is None and as_number("x") is None


def test_pass_at_k_is_the_unbiased_estimate_brute_forced() -> None:
    """Over every k-subset of n samples of which c are right, the share holding a right one."""
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


# --- suites -----------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_suites_load_from_jsonl_and_parquet_with_configured_fields(tmp_path: Path) -> None:
    rows = [{"problem": "Find 2+2.", "meta": {"id": "p1", "solution": 4}},
            {"problem": "Find 3+3.", "meta": {"id": "p2", "solution": 6}}]
    suite = EvalSuiteConfig(name="s", path=str(_write_jsonl(tmp_path / "s.jsonl", rows)), question_field="problem",
                            answer_field="meta.solution", id_field="meta.id")
    assert load_items(suite) == [QAItem("p1", "Find 2+2.", "4"), QAItem("p2", "Find 3+3.", "6")]
    pq.write_table(pa.Table.from_pylist([{"q": "Which is a gas?", "options": ["iron", "neon"], "a": "B"}]),
                   tmp_path / "g.parquet")
    gpqa = EvalSuiteConfig(name="g", path=str(tmp_path / "g.parquet"), question_field="q", answer_field="a",
                           choices_field="options", scorer="choice", prompt_template="{question}\n{choices}\nAnswer:")
    [item] = load_items(gpqa)
    assert prompt_text(gpqa, item) == "Which is a gas?\nA. iron\nB. neon\nAnswer:"
    assert len(load_items(EvalSuiteConfig(name="b", max_items=5))) == 5  # builtin:arithmetic


@pytest.mark.parametrize("rows, change, path, message", [
    (None, {"path": "/nonexistent/aime25.jsonl"}, "eval.suites[0].path", "no such file"),
    ([{"question": "q"}], {}, "eval.suites[0].answer_field", r"no field 'answer' \(its fields: question\)"),
    ([{"problem": "q", "answer": 1}], {}, "eval.suites[0].question_field", "no field 'question'"),
    ([{"question": "q", "answer": "1", "opts": "A or B"}], {"choices_field": "opts"}, "eval.suites[0].choices_field",
     "must be a list"),
    ([{"question": "q", "answer": "1", "id": 7}, {"question": "r", "answer": "2", "id": 7}], {"id_field": "id"},
     "eval.suites[0].id_field", "occurs more than once"),
    (None, {"path": "builtin:calculus"}, "eval.suites[0].path", "no built-in suite"),
    (None, {"path": "data.csv"}, "eval.suites[0].path", "cannot tell the format"),
    ([{"question": "q", "answer": "B", "opts": ["x", "y"]}], {"choices_field": "opts", "scorer": "choice"},
     "eval.suites[0].prompt_template", r"has no \{choices\}: the model would never see the options"),
    ([{"question": "q", "answer": "Paris"}], {"scorer": "choice"}, "eval.suites[0].answer_field",
     "'Paris' is no option letter"),
    ([{"question": "q", "answer": "ABC"}], {"scorer": "choice"}, "eval.suites[0].answer_field",
     "'ABC' is no option letter"),
    ([{"question": "q", "answer": "C", "opts": ["x", "y"]}],
     {"scorer": "choice", "choices_field": "opts", "prompt_template": "{question}\n{choices}"},
     "eval.suites[0].answer_field", "the item has 2 options"),
])
def test_a_bad_suite_is_refused_naming_the_setting(tmp_path: Path, rows: list | None, change: dict, path: str,
                                                   message: str) -> None:
    fields = {"name": "s", "path": str(_write_jsonl(tmp_path / "s.jsonl", rows)) if rows else "", **change}
    with pytest.raises(ConfigError, match=message) as info:
        load_items(EvalSuiteConfig(**fields))
    assert info.value.path == path


def test_a_broken_jsonl_line_is_named(tmp_path: Path) -> None:
    (tmp_path / "s.jsonl").write_text('{"question": "q", "answer": "1"}\n{"question": \n')
    with pytest.raises(ConfigError, match=r"s.jsonl:2: not a JSON object per line"):
        load_items(EvalSuiteConfig(name="s", path=str(tmp_path / "s.jsonl")))


@pytest.mark.parametrize("overrides, path", [
    (["eval.interval=2"], "eval.suites"),
    (["eval.suites=[{name: a}, {name: a}]"], "eval.suites[1].name"),
    (["eval.suites=[{name: 'a b'}]"], "eval.suites[0].name"),
    (["eval.suites=[{name: a, scorer: boxd}]"], "eval.suites[0].scorer"),
    (["eval.suites=[{name: a, samples: 0}]"], "eval.suites[0].samples"),
    (["eval.suites=[{name: a, kind: env}]"], "eval.suites[0].environments"),
    (["eval.suites=[{name: a, prompt_template: 'Solve it.'}]"], "eval.suites[0].prompt_template"),
    (["eval.interval=-1"], "eval.interval"),
])
def test_eval_config_errors_name_the_key(overrides: list[str], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["eval.before_train=false", "eval.suites=[]", *overrides])
    assert info.value.path == path


# --- the tiny model scored for real -----------------------------------------------------------------------------

QA = ("eval.suites=[{name: arith, path: 'builtin:arithmetic', max_items: 4, samples: 3, max_response_tokens: 12}, "
      "{name: echo, path: '%s', scorer: exact, max_items: 4, samples: 2, temperature: 0.0, "
      "max_response_tokens: 6}]")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights as a Hugging Face folder (seeded, wider than the init: livelier completions); the
    engine's own random init is not seeded, so engines that must agree start from here."""
    import torch

    from spade_mega.inference.hf import build_hf_model

    model = build_hf_model(load_config(TINY).model, dtype=torch.float32, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    """One torch thread, as the other engine tests run: two on this shared 2-core machine made generation 50x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _evaluate(cfg, pool=None, only=None):  # type: ignore[no-untyped-def]
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    engine = build_engine(cfg, tokenizer)
    try:
        return Evaluator(cfg, engine, tokenizer, pool, only=only).evaluate()
    finally:
        engine.close()


def test_the_tiny_model_is_scored_the_same_twice_and_scored_on_its_real_answers(tmp_path: Path,
                                                                               hf_folder: Path) -> None:
    """Two fresh hf engines on the same weights give the same completions and numbers. A second suite's references
    are then set to the model's own greedy replies for half the items: those score, the others do not."""
    echo = _write_jsonl(tmp_path / "echo.jsonl", [{"question": f"Say {w}.", "answer": "?"} for w in "abcd"])
    cfg = load_config(TINY, [QA % echo, f"inference.hf_weights={hf_folder}"])
    first, second = _evaluate(cfg), _evaluate(cfg)
    assert [(r.metrics, r.details) for r in first] == [(r.metrics, r.details) for r in second]
    arith = first[0].metrics
    assert set(arith) == {"accuracy", "pass_at_2", "pass_at_3", "response_tokens", "truncated", "items"}
    assert arith["items"] == 4 and 0 < arith["response_tokens"] <= 12 and 0 <= arith["truncated"] <= 1
    assert arith["accuracy"] == 0.0  # a random tiny model does no arithmetic

    replies = [d["answers"][0] for d in first[1].details]
    assert all(d["answers"][0] == d["answers"][1] for d in first[1].details)  # temperature 0: both samples agree
    _write_jsonl(echo, [{"question": f"Say {w}.", "answer": replies[i] if i < 2 else replies[i] + "#"}
                        for i, w in enumerate("abcd")])
    [echoed] = _evaluate(cfg, only=["echo"])
    assert echoed.metrics["accuracy"] == 0.5 and echoed.metrics["pass_at_2"] == 0.5
    assert [d["correct"] for d in echoed.details] == [2, 2, 0, 0]
    assert log_metrics([echoed])["eval/echo/accuracy"] == 0.5


def test_an_env_suite_is_played_by_the_agent_in_sandbox_workers(hf_folder: Path) -> None:
    cfg = load_config(TINY, [*ISOLATION, "eval.suites=[{name: games, kind: env, environments: [grid_maze, "
                                         "running_total], episodes: 2, max_response_tokens: 8}]",
                             "rollout.max_turns=2", f"inference.hf_weights={hf_folder}"])
    with SandboxPool(cfg.sandbox) as pool:
        first = _evaluate(cfg, pool)[0]
        again = _evaluate(cfg, pool)[0]
    assert first.metrics == again.metrics and first.details == again.details
    assert first.metrics["episodes"] == 4 and first.metrics["failed"] == 0.0 and 1 <= first.metrics["turns"] <= 2
    assert [d["environment"] for d in first.details] == ["grid_maze", "running_total"]
    assert all(len(d["returns"]) == 2 for d in first.details)


def test_an_unknown_environment_is_named_before_anything_is_played() -> None:
    cfg = load_config(TINY, ["eval.suites=[{name: g, kind: env, environments: [grid_mazes]}]"])
    with pytest.raises(ConfigError, match="no library environment 'grid_mazes'") as info:
        Evaluator(cfg, None, load_tokenizer(None))  # type: ignore[arg-type]
    assert info.value.path == "eval.suites[0].environments"


def test_a_prompt_too_long_for_the_context_is_refused_before_anything_is_generated(tmp_path: Path) -> None:
    """Found when the evaluator is built (before the run's first rollout), not at the first evaluation, hours in."""
    path = _write_jsonl(tmp_path / "long.jsonl", [{"question": "Short?", "answer": "1"},
                                                  {"question": "word " * 3000, "answer": "2"}])
    cfg = load_config(TINY, [f"eval.suites=[{{name: long, path: '{path}'}}]"])
    with pytest.raises(EvalError, match=r"suite 'long', item 1: the prompt has \d+ tokens"):
        Evaluator(cfg, None, load_tokenizer(cfg.model.tokenizer))  # type: ignore[arg-type]


def replies_engine(chat, replies: dict[str, str]):  # type: ignore[no-untyped-def]
    """An engine answering each question with a fixed reply (a model that writes given text: the tiny one cannot),
    as the scripted engines of the rollout tests do; the end-of-turn token ends every reply."""
    from solver_engine import ScriptedSolverEngine

    class Replies(ScriptedSolverEngine):
        def _answer(self, prompt: str) -> str:
            return next(reply for question, reply in replies.items() if question in prompt)

    return Replies(chat, [])


THOUGHTS = {  # question -> reply of a thinking model; every question's answer is 7
    "Q0?": "<think>\nIt is 3 + 4.\n</think>\n\n\\boxed{7}",  # right
    "Q1?": "<think>\nTry \\boxed{7}, then check the other cases and",  # cut off while thinking: no answer came
    "Q2?": "<think>\nA first guess: \\boxed{7}.\n</think>\n\nAnswer: 9",  # answered 9; the 7 was a guess
    "Q3?": "<think>\nSeven.\n</think>\nThe answer is \\boxed{7}.",  # right
}


@pytest.mark.parametrize("opens_reasoning", [False, True])
def test_a_thinking_models_answer_is_what_follows_its_reasoning(tmp_path: Path, opens_reasoning: bool) -> None:
    """Boxes inside the reasoning are not answers: a reply cut off before its </think> answered nothing, and a guess
    while thinking is not the final answer. With a template that opens the reasoning in the prompt (DeepSeek-R1,
    Qwen3 Thinking-2507) the reply carries only the </think>."""
    from spade_mega.rollout.chat import ChatTurns
    from spade_mega.tokenizer import CHATML_TEMPLATE, byte_tokenizer

    tokenizer = byte_tokenizer()
    replies = dict(THOUGHTS)
    if opens_reasoning:
        tokenizer.chat_template = CHATML_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
        replies = {q: r.removeprefix("<think>\n") for q, r in replies.items()}
    path = _write_jsonl(tmp_path / "t.jsonl", [{"question": q, "answer": "7"} for q in THOUGHTS])
    cfg = load_config(TINY, [f"eval.suites=[{{name: t, path: '{path}', samples: 2}}]"])
    evaluator = Evaluator(cfg, None, tokenizer)  # type: ignore[arg-type]
    assert ("<think>" in decode_prompt(evaluator, tokenizer)) is opens_reasoning
    evaluator.engine = replies_engine(evaluator.chat, replies)
    [result] = evaluator.evaluate()
    assert [d["correct"] for d in result.details] == [2, 0, 0, 2]
    assert [d["answers"][0] for d in result.details] == ["7", None, "9", "7"]


def decode_prompt(evaluator: Evaluator, tokenizer) -> str:  # type: ignore[no-untyped-def]
    from spade_mega.rollout.chat import decode

    return decode(tokenizer, next(iter(evaluator.prompts.values()))[0])


# --- code: run in sandbox workers ------------------------------------------------------------------------------

ADD = [("1 2\n", "3\n"), ("10 20\n", "30")]
SOLUTIONS = {  # solution -> passes both tests?
    "a, b = map(int, input().split())\nprint(a + b)\n": True,
    "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nsys.stdout.write(f'{a + b}\\n')\n": True,
    "import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)\n": True,
    "a, b = map(int, open(0).read().split())\nprint(a + b)\n": True,  # the competitive programmer's stdin
    "print(sum(map(int, open(0, 'rb').read().split())))\n": True,
    "a, b = map(int, input().split())\nprint(a * b)\n": False,  # right on neither
    "a, b = map(int, input().split())\nprint(3)\n": False,  # right on the first test only
    "while True:\n    pass\n": False,  # past sandbox.call_timeout_s
    "raise ValueError('no')\n": False,
    "import os\nos._exit(3)\n": False,  # kills its worker
    # the expected outputs are not in the worker: a program that looks for them finds nothing to copy
    "import sys\nprint(sys._getframe(1).f_locals['case'][1])\n": False,
    "import gc\nprint(next(o for o in gc.get_objects() if isinstance(o, list) and o and o[0] == ['1 2\\n', '3\\n'])"
    "[int(input().split()[0]) // 10][1])\n": False,
}


def test_code_solutions_run_against_their_tests_in_sandbox_workers() -> None:
    from spade_mega.evaluation.code import extract_code, run_tests

    cfg = load_config(TINY, [*ISOLATION, "sandbox.call_timeout_s=1"])
    solutions = [*SOLUTIONS, None]  # None: no code block in the reply
    with SandboxPool(cfg.sandbox) as pool:
        assert run_tests(pool, solutions, [ADD] * len(solutions), width=4) == [*SOLUTIONS.values(), False]
    reply = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\nDone."
    assert extract_code(reply) == "print(2)\n" and extract_code("print(2)") is None


@pytest.mark.parametrize("answer, message", [
    ("[]", "non-empty list of test cases"),
    ('[{"input": "1"}]', "needs text 'input' and 'output'"),
    ('[{"input": "1", "output": "2", "testtype": "functional"}]', "'functional' is not supported"),
    ("not json", "not JSON"),
])
def test_code_suite_test_cases_are_checked_when_loaded(tmp_path: Path, answer: str, message: str) -> None:
    path = _write_jsonl(tmp_path / "lcb.jsonl", [{"question": "Add two numbers.", "answer": answer}])
    with pytest.raises(ConfigError, match=message) as info:
        load_items(EvalSuiteConfig(name="lcb", path=str(path), scorer="code"))
    assert info.value.path == "eval.suites[0].answer_field"


def test_a_code_suite_is_scored_end_to_end(tmp_path: Path, hf_folder: Path) -> None:
    """The tiny model writes no code block: every sample fails, through the whole path (prompt, engine,
    extraction, sandbox); the suite needs a pool."""
    path = _write_jsonl(tmp_path / "lcb.jsonl", [{"question": "Add two numbers.", "answer": json.dumps(
        [{"input": i, "output": o, "testtype": "stdin"} for i, o in ADD])}])
    cfg = load_config(TINY, [*ISOLATION, f"inference.hf_weights={hf_folder}",
                             f"eval.suites=[{{name: lcb, path: '{path}', scorer: code, samples: 2, "
                             "max_response_tokens: 8}]"])
    with pytest.raises(EvalError, match="run in sandbox workers"):
        _evaluate(cfg)
    with SandboxPool(cfg.sandbox) as pool:
        [result] = _evaluate(cfg, pool)
    assert result.metrics["accuracy"] == 0.0 and result.details[0]["reference"] == "2 test cases"
    assert result.details[0]["answers"] == [None, None]


# --- in the loop, and `spade-mega eval` -------------------------------------------------------------------------

LOOP = ["selfplay.num_rollouts=2", "selfplay.regen_interval=2", "selfplay.save_interval=2",
        "selfplay.global_batch_size=4", "rollout.envs_per_rollout=1", "rollout.agent_trajectories_per_env=2",
        "rollout.hint_plays_per_env=1", "rollout.max_turns=2", "rollout.max_response_tokens=8",
        "rollout.max_designer_tokens=16", "curriculum.corpus.token_budget=64", "logging.tensorboard=false",
        "logging.progress=false", "eval.interval=2", "eval.before_train=true"]


@pytest.mark.slow
def test_the_loop_evaluates_at_its_interval_and_eval_rescores_the_checkpoint(tmp_path: Path) -> None:
    """Scores at step 0 (before training) and 2 (eval.interval), none at 1; the report's evaluation table; then
    `spade-mega eval --checkpoint` on the saved checkpoint of rollout 2 reproduces the loop's step-2 scores."""
    train = subprocess.run([str(SCRIPT), "train", str(TINY), f"run.output_dir={tmp_path}", *LOOP, *ISOLATION],
                           capture_output=True, text=True, timeout=600, cwd=ROOT, env=ONE_THREAD)
    assert train.returncode == 0, train.stderr[-4000:]
    run_dir = tmp_path / "tiny_cpu"
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [0, 1, 2]
    scored = {step for step, r in records.items() if "eval/arithmetic/accuracy" in r}
    assert scored == {0, 2}
    assert records[2]["time/eval_s"] > 0 and records[0]["eval/arithmetic/items"] == 4
    assert '<h2 id="evaluation">Evaluation</h2>' in (run_dir / "report.html").read_text()

    out = tmp_path / "results.json"
    cli = subprocess.run([str(SCRIPT), "eval", str(TINY), f"run.output_dir={tmp_path}", *ISOLATION,
                          "--checkpoint", str(run_dir / "checkpoints"), "-o", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=ONE_THREAD)
    assert cli.returncode == 0, cli.stderr[-4000:]
    assert "arithmetic (qa)" in cli.stdout and "accuracy" in cli.stdout
    result = json.loads(out.read_text())
    assert result["step"] > 0 and [s["name"] for s in result["suites"]] == ["arithmetic"]
    assert {f"eval/arithmetic/{k}": v for k, v in result["suites"][0]["metrics"].items()} == \
        {k: v for k, v in records[2].items() if k.startswith("eval/")}


FAILING_EVAL = """
import sys
from spade_mega.cli import main
from spade_mega.errors import SpadeError
from spade_mega.evaluation.runner import Evaluator

def evaluate(self):
    raise SpadeError("the engine ran out of memory on a 30k-token answer")

Evaluator.evaluate = evaluate  # the failure under test: what an engine failing mid-evaluation raises
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_an_evaluation_that_fails_loses_no_training(tmp_path: Path) -> None:
    """The evaluation of a save rollout runs after its checkpoint: when it fails the run stops (exit 2, naming the
    error) with that rollout's training saved (the evaluation ran before the save, which then never happened) and
    its metrics logged."""
    loop = [arg for arg in LOOP if not arg.startswith(("selfplay.num_rollouts", "eval."))]
    train = subprocess.run([sys.executable, "-c", FAILING_EVAL, "train", str(TINY), f"run.output_dir={tmp_path}",
                            *loop, *ISOLATION, "selfplay.num_rollouts=1", "eval.interval=1",
                            "eval.before_train=false"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT, env=ONE_THREAD)
    assert train.returncode == 2 and "ran out of memory" in train.stderr.splitlines()[-1], train.stderr[-3000:]
    assert [p.name for p in (tmp_path / "tiny_cpu" / "checkpoints").glob("step_*")] != []
    # and the rollout's own metrics are logged (the resumed run starts after it)
    [record] = map(json.loads, (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines())
    assert record["step"] == 1 and "train/loss" in record and not any(k.startswith("eval/") for k in record)


KILLED_EVAL = """
import os
import signal
import sys
from spade_mega.cli import main
from spade_mega.evaluation.runner import Evaluator

def evaluate(self):
    os.kill(os.getpid(), signal.SIGKILL)  # the job killed mid-evaluation: a time limit's SIGKILL, a lost node

Evaluator.evaluate = evaluate
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_job_killed_during_evaluation_loses_nothing_its_resume_cannot_redo(tmp_path: Path) -> None:
    """Killed (SIGKILL: no handler, no exit code) while scoring its last rollout's checkpoint, the job has logged
    that rollout's metrics; the same command resumes and scores the checkpoint first, at the rollout's step (the
    weights and seeds a straight run would have used: test_selfplay's resumed run logs the straight run's scores)."""
    loop = [arg for arg in LOOP if not arg.startswith(("selfplay.num_rollouts", "eval."))]
    args = ["train", str(TINY), f"run.output_dir={tmp_path}", *loop, *ISOLATION, "selfplay.num_rollouts=1",
            "eval.interval=1", "eval.before_train=false"]
    killed = subprocess.run([sys.executable, "-c", KILLED_EVAL, *args], capture_output=True, text=True, timeout=600,
                            cwd=ROOT, env=ONE_THREAD)
    assert killed.returncode == -9, killed.stderr[-3000:]
    metrics = tmp_path / "tiny_cpu" / "metrics.jsonl"
    [rollout] = map(json.loads, metrics.read_text().splitlines())
    assert rollout["step"] == 1 and "train/loss" in rollout and not any(k.startswith("eval/") for k in rollout)

    resumed = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT,
                             env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "evaluating the checkpoint of rollout 1 first" in resumed.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1] and records[0] == rollout
    assert records[1]["eval/arithmetic/items"] == 4 and records[1]["time/eval_s"] > 0
    assert scores_logged(metrics, 1)  # so a later resume does not score it again


def test_a_resume_finds_the_scores_of_a_step_in_the_metrics_file(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert not scores_logged(metrics, 2)  # no file yet
    lines = ['{"step": 1, "time": 1.0, "eval/a/accuracy": 0.5}', '{"step": 2, "time": 2.0, "train/loss": 1.0}']
    metrics.write_text("\n".join(lines) + "\n{not json\n")
    assert scores_logged(metrics, 1) and not scores_logged(metrics, 2)  # the rollout's record is no score
    metrics.write_text("\n".join(lines + ['{"step": 2, "time": 3.0, "eval/a/accuracy": 0.25}']) + "\n")
    assert scores_logged(metrics, 2)


def test_eval_scores_a_hugging_face_folder(tmp_path: Path, hf_folder: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The command's engine serves the folder's weights: its answers are those of an engine started from them."""
    suite = "eval.suites=[{name: arithmetic, max_items: 3, temperature: 0.0, max_response_tokens: 6}, {name: other}]"
    assert main(["eval", str(TINY), suite, "--hf-weights", str(hf_folder), "-o", str(tmp_path / "a.json"),
                 "--suite", "arithmetic"]) == 0
    assert "arithmetic (qa)" in capsys.readouterr().out
    result = json.loads((tmp_path / "a.json").read_text())
    assert result["hf_weights"] == str(hf_folder.absolute()) and len(result["suites"]) == 1
    [direct] = _evaluate(load_config(TINY, [suite, f"inference.hf_weights={hf_folder}"]), only=["arithmetic"])
    assert result["suites"][0]["details"] == direct.details and result["suites"][0]["metrics"] == direct.metrics


def test_under_torchrun_only_rank_0_scores_a_hugging_face_folder(tmp_path: Path, hf_folder: Path) -> None:
    """An HF folder needs no trainer, so no rank but 0 has anything to do: it exits at once (every rank built an
    engine and scored the suites, writing the same file)."""
    out = tmp_path / "r1.json"
    rank1 = subprocess.run([str(SCRIPT), "eval", str(TINY), "--hf-weights", str(hf_folder), "-o", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env={**ONE_THREAD, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert rank1.returncode == 0, rank1.stderr[-3000:]
    assert not out.exists() and "accuracy" not in rank1.stdout


def test_a_server_eval_starts_leaves_no_scratch_folder_when_it_fails_or_is_killed(tmp_path: Path,
                                                                                   hf_folder: Path) -> None:
    """A server `eval` starts writes its log (and, without inference.hf_weights, its random starting folder: the
    model's size) into a spade-eval-* folder of $TMPDIR: removed when that server fails to start; one left by an
    eval killed with SIGKILL (SIGTERM too: Python runs no cleanup on it) is removed by the next eval, as the engine's
    staging folders are, and one of an eval still running is not. No vllm needed: the server's "python" here never
    serves (a sleep) or exits at once."""
    import signal
    import time

    never, fails = tmp_path / "never-serves", tmp_path / "fails"
    never.write_text("#!/bin/sh\nexec sleep 300\n")
    fails.write_text("#!/bin/sh\necho no vllm here\nexit 1\n")
    never.chmod(0o755)
    fails.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    weights = ["--hf-weights", str(hf_folder)]
    command = [str(SCRIPT), "eval", str(TINY), "rollout.engine=vllm", f"run.output_dir={tmp_path / 'runs'}",
               "inference.startup_timeout_s=300"]
    env = {**ONE_THREAD, "TMPDIR": str(scratch)}

    def waiting() -> tuple[subprocess.Popen, Path]:  # an eval waiting for its server, and its scratch folder
        started = set(scratch.glob("spade-eval-*/*/vllm-server.log"))
        process = subprocess.Popen([*command, f"inference.server_python={never}", *weights], env=env, cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while not (new := set(scratch.glob("spade-eval-*/*/vllm-server.log")) - started):
            assert process.poll() is None and time.monotonic() < deadline, "the eval never started its server"
            time.sleep(0.5)
        return process, new.pop().parents[1]

    killed, left = waiting()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    running, its_own = waiting()
    try:
        failed = subprocess.run([*command, f"inference.server_python={fails}", *weights], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert failed.returncode == 2 and "no vllm here" in failed.stderr, failed.stderr[-3000:]
        assert not left.exists() and its_own.is_dir()  # the dead eval's folder went, the running one's stays
        # the failed one's went too; so did the killed eval's server's TMPDIR, the running one's server's stays
        servers = {p.name for p in scratch.glob("spade-vllm-tmp-*")}
        assert len(servers) == 2 and any(name.endswith(".owner") for name in servers), servers
        assert {p.name for p in scratch.iterdir()} == {its_own.name, f"{its_own.name}.owner"} | servers
    finally:
        running.send_signal(signal.SIGTERM)
        running.wait()
    assert not (tmp_path / "runs").exists()  # nothing of any of them in the run directory


def test_a_starting_folder_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    """The random starting folder of a server started without inference.hf_weights takes the model's full size (in
    $TMPDIR under `eval`, often a small disk): a write that fails (here a file size limit, as a full disk) is an
    error naming the folder and what to do, not safetensors' raw serialisation error."""
    folder = tmp_path / "engine-model"
    script = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from spade_mega.config.loader import load_config
from spade_mega.errors import SpadeError
from spade_mega.inference.server import write_model_folder
from spade_mega.tokenizer import load_tokenizer
cfg = load_config({str(TINY)!r})
try:
    write_model_folder(Path({str(folder)!r}), cfg.model, load_tokenizer(cfg.model.tokenizer))
except SpadeError as exc:
    sys.exit(f"refused: {{exc}}")
"""
    done = subprocess.run([sys.executable, "-c", "from pathlib import Path\n" + script], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=ONE_THREAD)
    assert done.returncode == 1 and "refused: " in done.stderr, done.stderr[-3000:]
    assert str(folder) in done.stderr and "inference.hf_weights" in done.stderr and "File too large" in done.stderr


def test_eval_refuses_without_weights_or_with_an_unknown_suite(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", str(TINY)]) == 2
    assert "give --checkpoint" in capsys.readouterr().err
    assert main(["eval", str(TINY), "--hf-weights", str(tmp_path), "--suite", "aime"]) == 2
    assert "no suite named 'aime'" in capsys.readouterr().err


@pytest.mark.multiproc
def test_an_eval_failure_on_rank_0_stops_every_rank_naming_it(tmp_path: Path) -> None:
    """Two ranks started as srun starts its tasks (no torchrun agent to kill the survivor): rank 0 cannot build its
    engine, so rank 1 must not wait for it in the weight sync (over gloo it died there with 'Connection closed by
    peer', over NCCL it would hang); every rank exits 2 with rank 0's error."""
    from spade_mega.inference.server import free_port

    checkpoint = tmp_path / "checkpoints"
    save = ("import sys; from spade_mega.config.loader import load_config; from spade_mega.megatron import Trainer; "
            "Trainer(load_config(sys.argv[1])).save(sys.argv[2])")
    subprocess.run([sys.executable, "-c", save, str(TINY), str(checkpoint)], check=True, capture_output=True,
                   timeout=300, cwd=ROOT, env=ONE_THREAD)
    (tmp_path / "empty").mkdir()
    port = str(free_port())
    ranks = [subprocess.Popen([str(SCRIPT), "eval", str(TINY), f"inference.hf_weights={tmp_path / 'empty'}",
                               "--checkpoint", str(checkpoint)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT,
                              env={**ONE_THREAD, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], errors[1][-3000:]
    assert "no *.safetensors files" in errors[0].splitlines()[-1]
    assert "rank 0 failed, so rank 1 stops too: EngineError" in errors[1].splitlines()[-1]


WAIT_FOR_RANK_0 = """
import sys, time
import torch.distributed as dist
from spade_mega.config.loader import load_config
from spade_mega.megatron.parallel import init_distributed, shutdown
from spade_mega.selfplay.loop import _from_rank0

init_distributed(load_config(sys.argv[1], sys.argv[2:]).parallel)
print(_from_rank0(lambda: time.sleep(4) or "scored", share=True))  # rank 0 evaluates; the others wait for it
shutdown()  # as every spade-mega command leaves: gloo's teardown at exit can abort a rank whose peer has gone
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("minutes, waits", [(0.02, False), (1.0, True)])
def test_the_ranks_wait_for_rank_0_as_long_as_parallel_collective_timeout_min(minutes: float, waits: bool) -> None:
    """While rank 0 rolls out or evaluates (tens of minutes for a long-answer suite), the others wait in one
    collective: the process group's timeout, parallel.collective_timeout_min, bounds that wait. It was torch's
    default (NCCL 10 minutes, gloo 30), so a longer evaluation killed every other rank. Here rank 0 takes 4 s."""
    from spade_mega.inference.server import free_port

    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", WAIT_FOR_RANK_0, str(TINY),
                               f"parallel.collective_timeout_min={minutes}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**ONE_THREAD, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    if waits:
        assert [rank.returncode for rank in ranks] == [0, 0], outputs[1][1][-3000:]
        assert [out.split() for out, _ in outputs] == [["scored"], ["scored"]]
    else:  # rank 1 gave up after 1.2 s (rank 0 then found nobody to send to)
        assert ranks[1].returncode != 0 and "timed out" in outputs[1][1].lower(), outputs[1][1][-3000:]


def test_an_env_suite_counts_a_play_its_program_broke_as_failed_at_its_reward(hf_folder: Path) -> None:
    """Held-out scores keep every episode (training's rates leave a broken play out): a break in a held-out program
    counts at the reward the episode ended with, 0 when truncated, and in ``failed``; every checkpoint is scored over
    the same episodes. Here a program that any action wins beside one whose step() always raises."""
    import textwrap

    from spade_mega.envs.program import EnvProgram

    source = textwrap.dedent('''
        class Gate:
            max_turns = 2

            def reset(self, seed):
                return "A gate."

            def step(self, action):
                %s
    ''')
    opens = EnvProgram(source % 'return "It opens.", 1.0, True, False, {}', "Anything opens it.", "logic")
    breaks = EnvProgram(source % 'raise ValueError("the gate is broken")', "Nothing opens it.", "logic")
    cfg = load_config(TINY, [*ISOLATION, "eval.suites=[{name: gates, kind: env, environments: [grid_maze, "
                                         "running_total], episodes: 2, max_response_tokens: 8}]",
                             "rollout.max_turns=2", f"inference.hf_weights={hf_folder}"])
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    engine = build_engine(cfg, tokenizer)
    try:
        with SandboxPool(cfg.sandbox) as pool:
            evaluator = Evaluator(cfg, engine, tokenizer, pool)
            evaluator.programs["gates"] = [("opens", opens), ("breaks", breaks)]
            (result,) = evaluator.evaluate()
    finally:
        engine.close()
    assert [d["failures"] for d in result.details] == [[], ["sandbox_error", "sandbox_error"]]
    assert result.metrics["episodes"] == 4 and result.metrics["failed"] == 0.5
    assert result.metrics["return"] == 0.5 and result.metrics["win_rate"] == 0.5  # 1.0 without the broken plays
