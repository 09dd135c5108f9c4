"""Designer-output and agent-output parsing: valid outputs, every reason code, and adversarial fuzzing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spade_mega.curriculum.parsing import (DesignerParseError, ParseReason, parse_agent_output,
                                           parse_designer_output)
from spade_mega.envs.program import EnvProgram

SKILLS = ("arithmetic", "logic", "navigation", "science", "code_tracing", "tool_use")
GOOD_SOURCE = '''import random


class Counter:
    """Reach the target by adding 1 or 2."""

    max_turns = 10

    def reset(self, seed: int) -> str:
        self.rng = random.Random(seed)
        self.target, self.total = self.rng.randint(5, 9), 0
        return f"Reach {self.target}. Reply 1 or 2."

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.total += 2 if action.strip() == "2" else 1
        done = self.total >= self.target
        return f"total {self.total}", float(self.total == self.target) if done else 0.0, done, False, {}
'''


def output(skill: str = "arithmetic", hint: str = "count the remaining distance",
           source: str = GOOD_SOURCE, lang: str = "python") -> str:
    return f"<skill>{skill}</skill>\n<hint>{hint}</hint>\n```{lang}\n{source}```\n"


def reason_of(text: str, **kwargs) -> ParseReason:
    with pytest.raises(DesignerParseError) as info:
        parse_designer_output(text, SKILLS, **kwargs)
    return info.value.reason


def test_valid_output_gives_program_hint_and_skill() -> None:
    prov = {"origin": "designer", "iteration": 3}
    program = parse_designer_output(output(), SKILLS, expected_skill="arithmetic", provenance=prov)
    assert isinstance(program, EnvProgram)
    assert program.source == GOOD_SOURCE and program.hint == "count the remaining distance"
    assert program.skill == "arithmetic" and program.provenance == prov


def test_reasoning_block_with_code_is_ignored_and_tags_are_case_insensitive() -> None:
    text = ("<think>maybe\n```python\nclass Draft:\n    def reset(self, s): ...\n    def step(self, a): ...\n```\n"
            "</think>\n" + output(skill=" Logic ").replace("<hint>", "<HINT>").replace("</hint>", "</Hint>"))
    program = parse_designer_output(text, SKILLS)
    assert program.skill == "logic" and "Counter" in program.source


def test_helper_classes_are_allowed_beside_one_environment_class() -> None:
    source = "class Cell:\n    pass\n\n" + GOOD_SOURCE
    assert parse_designer_output(output(source=source), SKILLS).source == source


# One example per reason code: every code is reachable.
REASON_EXAMPLES: dict[ParseReason, tuple[str, dict]] = {
    ParseReason.EMPTY: ("  \n\t ", {}),
    ParseReason.TRUNCATED: (output()[:-5], {}),
    ParseReason.NO_CODE_BLOCK: ("<skill>logic</skill><hint>h</hint> class A: pass", {}),
    ParseReason.SEVERAL_CODE_BLOCKS: (output() + "```python\nx = 1\n```\n", {}),
    ParseReason.TOO_LONG: (output(source=GOOD_SOURCE + "#" * 200 + "\n"), {"max_source_chars": 100}),
    ParseReason.SYNTAX_ERROR: (output(source="class A(:\n"), {}),
    ParseReason.NO_ENV_CLASS: (output(source="class A:\n    def reset(self, seed):\n        return ''\n"), {}),
    ParseReason.SEVERAL_CLASSES: (output(source=GOOD_SOURCE + GOOD_SOURCE.replace("Counter", "Other")), {}),
    ParseReason.MISSING_HINT: (output().replace("<hint>count the remaining distance</hint>", ""), {}),
    ParseReason.SEVERAL_HINTS: (output() + "<hint>again</hint>", {}),
    ParseReason.MISSING_SKILL: (output(skill="   "), {}),
    ParseReason.SEVERAL_SKILLS: ("<skill>logic</skill>" + output(), {}),
    ParseReason.UNKNOWN_SKILL: (output(skill="juggling"), {}),
    ParseReason.WRONG_SKILL: (output(skill="logic"), {"expected_skill": "arithmetic"}),
}


def test_every_reason_code_has_an_example() -> None:
    assert set(REASON_EXAMPLES) == set(ParseReason)


@pytest.mark.parametrize("reason", list(ParseReason), ids=lambda r: r.value)
def test_each_reason_code_is_reachable(reason: ParseReason) -> None:
    text, kwargs = REASON_EXAMPLES[reason]
    assert reason_of(text, **kwargs) is reason


def test_truncation_by_token_limit_and_unclosed_reasoning() -> None:
    assert reason_of(output(), finished=False) is ParseReason.TRUNCATED
    assert reason_of("<think>still thinking about " + output()) is ParseReason.TRUNCATED
    assert reason_of("<think>done</think>   ") is ParseReason.EMPTY


def test_null_bytes_and_deep_nesting_are_syntax_errors_not_crashes() -> None:
    assert reason_of(output(source="x = 1\x00\n")) is ParseReason.SYNTAX_ERROR
    assert reason_of(output(source="x = " + "(" * 5000 + "1" + ")" * 5000 + "\n")) is ParseReason.SYNTAX_ERROR
    assert reason_of(output(source="x = " + "-" * 90000 + "1\n")) in (ParseReason.SYNTAX_ERROR,
                                                                      ParseReason.NO_ENV_CLASS)


def test_parsing_never_executes_the_program(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    source = f"open({str(marker)!r}, 'w').write('x')\n" + GOOD_SOURCE
    parse_designer_output(output(source=source), SKILLS)
    assert not marker.exists()


def test_error_message_names_the_reason() -> None:
    with pytest.raises(DesignerParseError) as info:
        parse_designer_output(output(skill="juggling"), SKILLS)
    assert "unknown_skill" in str(info.value) and "juggling" in str(info.value)


# ------------------------------------------------------------------------------------------------------ fuzzing

FRAGMENTS = [
    "```", "```python", "```py", "```text", "```\n", "\n```python\n", "<hint>", "</hint>", "<skill>", "</skill>",
    "<think>", "</think>", "logic", "arithmetic", "juggling", "class A:\n", "    def reset(self, seed):\n",
    "        return 'x'\n", "    def step(self, a):\n", "        return ('', 0.0, True, False, {})\n", "(((((", ")))",
    "\x00", "\r\n", "\t", "é€😀", "lambda: ", "def f(:\n", "import os\n", "\\", "'''", '"""', "async def reset(s):\n",
    GOOD_SOURCE, output(), "<hint></hint>", "<skill>tool_use</skill>", "\u2028", "#" * 50, "\n" * 3,
]


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        if op == 0:
            text = text[:i] + text[j:]  # delete a slice
        elif op == 1:
            text = text[:i] + rng.choice(FRAGMENTS) + text[i:]  # insert a fragment
        elif op == 2:
            text = text[:j] + text[i:j] + text[j:]  # duplicate a slice
        else:
            text = text[:i]  # cut (truncated output)
    return text


def _parse_outcome(text: str, **kwargs) -> ParseReason | None:
    try:
        program = parse_designer_output(text, SKILLS, **kwargs)
    except DesignerParseError as exc:
        assert isinstance(exc.reason, ParseReason) and exc.detail
        return exc.reason
    assert isinstance(program, EnvProgram) and program.skill in SKILLS and program.hint
    return None


def test_thousands_of_mutated_outputs_raise_only_the_typed_error_and_reach_every_reason() -> None:
    rng = random.Random(0)
    seen: set[ParseReason | None] = set()
    for case in range(5000):
        base = rng.choice([output(skill=rng.choice(SKILLS + ("juggling",))),
                           "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))])
        text = _mutate(rng, base) if rng.random() < 0.8 else base
        kwargs = {"expected_skill": rng.choice(SKILLS)} if case % 3 == 0 else {}
        if case % 7 == 0:
            kwargs["max_source_chars"] = rng.randint(1, 2000)
        if case % 11 == 0:
            kwargs["finished"] = False
        seen.add(_parse_outcome(text, **kwargs))
    assert set(ParseReason) | {None} == seen


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=40)), max_size=25),
       st.sampled_from([None, *SKILLS]))
def test_property_arbitrary_fragment_soup_raises_only_the_typed_error(parts: list[str], expected: str | None) -> None:
    _parse_outcome("".join(parts), expected_skill=expected)


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=2000))
def test_property_arbitrary_unicode_text_raises_only_the_typed_error(text: str) -> None:
    _parse_outcome(text)


def test_adversarial_unclosed_tags_parse_in_linear_time() -> None:
    text = "<hint>" * 20000 + "\n```python\n" + GOOD_SOURCE + "```\n" + "<skill>" * 20000
    assert reason_of(text) is ParseReason.MISSING_HINT


# ------------------------------------------------------------------------------------------------------- agent

def test_agent_action_is_last_action_tag_after_reasoning() -> None:
    action = parse_agent_output("<think>try <action>left</action>?</think>I go <action>up</action> then "
                                "<action> right </action>")
    assert action.text == "right" and action.well_formed


def test_agent_output_without_tag_falls_back_to_the_answer() -> None:
    action = parse_agent_output("<think>hmm</think>\n  42  \n")
    assert action.text == "42" and not action.well_formed
    assert parse_agent_output("x" * 10000, max_chars=100).text == "x" * 100


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=500))
def test_property_agent_parser_never_raises(text: str) -> None:
    action = parse_agent_output(text)
    assert isinstance(action.text, str) and len(action.text) <= 4096


# ------------------------------------------------------------------------------------------- fences and reasoning

DOC_WITH_FENCE = '''class Quiz:
    """Example round:
```
guess 3
```
"""

    def reset(self, seed):
        return "guess"

    def step(self, a):
        return "", 0.0, True, False, {}
'''


@pytest.mark.parametrize("open_fence, close_fence", [("````python", "````"), ("~~~python", "~~~"),
                                                     ("```python title=env.py", "```"), ("`````py", "``````")])
def test_longer_tilde_and_info_string_fences_hold_the_program(open_fence: str, close_fence: str) -> None:
    # CommonMark: a fence closes only with the same character, at least as long, so a program whose text holds ```
    # lines can be sent inside a longer fence; an info string after the language is allowed.
    source = DOC_WITH_FENCE if open_fence[0] == close_fence[0] and len(close_fence) > 3 else GOOD_SOURCE
    text = f"<skill>logic</skill>\n<hint>h</hint>\n{open_fence}\n{source}{close_fence}\n"
    assert parse_designer_output(text, SKILLS).source == source


def test_a_shorter_or_other_fence_inside_a_block_does_not_close_it() -> None:
    text = f"<skill>logic</skill>\n<hint>h</hint>\n````python\n{DOC_WITH_FENCE}~~~~\n"
    assert reason_of(text) is ParseReason.TRUNCATED  # ``` and ~~~~ lines are content of a ```` block


@pytest.mark.timeout(60)  # a hang guard (backtracking took hours at this size), not a speed claim
@pytest.mark.parametrize("line", ["```" + " " * 200_000 + "!", "```python" + "\t " * 100_000 + "x",
                                  "~~~" + " " * 200_000 + "`", " " * 200_000 + "```"])
def test_fence_lines_full_of_whitespace_do_not_backtrack(line: str) -> None:
    assert reason_of(f"<skill>logic</skill>\n<hint>h</hint>\n{line}\n") in (ParseReason.NO_CODE_BLOCK,
                                                                          ParseReason.TRUNCATED)


def test_think_tags_inside_the_answer_are_program_text() -> None:
    # The reasoning block ends at the first </think> (a thinking model always emits one, Qwen3 even an empty one);
    # the program may itself mention the tags (an environment about chat formats), and a <think> that does not open
    # the output starts no reasoning block.
    source = GOOD_SOURCE.replace('f"total {self.total}"', '"strip <think>...</think> from replies"')
    for text in ("<think>plan</think>\n" + output(source=source), "<think>\n\n</think>\n\n" + output(source=source),
                 "okay, done thinking</think>\n" + output(source=source)):
        assert parse_designer_output(text, SKILLS).source == source
    opened_late = GOOD_SOURCE.replace('f"total {self.total}"', '"reply <think> to think"')
    assert parse_designer_output(output(source=opened_late), SKILLS).source == opened_late
    assert parse_agent_output("<think>a</think><action>say </think></action>").text == "say </think>"


@pytest.mark.parametrize("char", ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"])
def test_unicode_line_separators_inside_the_program_are_kept(char: str) -> None:
    # Python ends source lines only at \n, \r\n and \r; str.splitlines also splits at these characters, so a valid
    # program holding one in a string literal was rebuilt with a newline there (syntax_error, or changed text).
    source = GOOD_SOURCE.replace('f"total {self.total}"', f'"total{char}{{self.total}}"')
    program = parse_designer_output(output(source=source, hint=f"count{char}down"), SKILLS)
    assert program.source == source and program.hint == f"count{char}down"


def test_crlf_output_parses_like_lf() -> None:
    text = output().replace("\n", "\r\n")
    assert parse_designer_output(text, SKILLS).source == GOOD_SOURCE


def test_an_indented_fence_in_a_docstring_does_not_close_the_block() -> None:
    # CommonMark: a closing fence is indented by at most 3 spaces more than its opening one; the program's docstring
    # may show a reply format between ``` lines indented with the code.
    source = GOOD_SOURCE.replace('"""Reach the target by adding 1 or 2."""',
                                 '"""Reach the target by adding 1 or 2.\n\n    Reply like this:\n\n    ```\n    2\n'
                                 '    ```\n    """')
    assert parse_designer_output(output(source=source), SKILLS).source == source
    # A whole answer indented (as in a list item) still parses: the block closes at its own indentation.
    indented = "\n".join("    " + line if line else line for line in output().splitlines()) + "\n"
    assert parse_designer_output(indented, SKILLS).source == GOOD_SOURCE  # its indentation removed, as in CommonMark
    # A fence indented alone keeps its lines as written (two-space code would otherwise lose its nesting).
    two_spaces = GOOD_SOURCE.replace("    ", "  ")
    text = f"<skill>logic</skill>\n<hint>h</hint>\n   ```python\n{two_spaces}   ```\n"
    assert parse_designer_output(text, SKILLS).source == two_spaces
