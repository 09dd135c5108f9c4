"""Prompts: designer / agent / hint-play content, chat-template rendering and the plain fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from spade_mega.config import load_config
from spade_mega.curriculum.corpus import GroundingDocument
from spade_mega.curriculum.memory import EnvMemory
from spade_mega.curriculum.parsing import parse_designer_output
from spade_mega.curriculum.prompts import PromptBuilder, PromptError, load_contract, render
from spade_mega.curriculum.skills import SkillRegistry
from spade_mega.envs.program import EnvProgram
from spade_mega.tokenizer import byte_tokenizer

DOCS = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


class NoTemplate:
    """A tokenizer without a chat template (a base model's)."""

    chat_template = None


@pytest.fixture
def builder() -> PromptBuilder:
    return PromptBuilder(SkillRegistry.from_config(load_config().curriculum), byte_tokenizer())


def seeded_memory(tmp_path: Path) -> EnvMemory:
    mem = EnvMemory(tmp_path / "m.sqlite")
    contract_example = load_contract().split("```python\n")[1].split("```")[0]
    rows = [(contract_example, "bisect the range", 0.2, 0.9),
            (contract_example.replace("GuessNumber", "Easy").replace("Guess a secret", "Trivially guess"),
             "h", 0.95, 1.0),
            ("class Helper:\n    pass\n\n\nclass Wall:\n    '''Walk through a wall.'''\n    def reset(self, s): ...\n    def step(self, a): ...\n",
             "h", 0.0, 0.0)]
    for i, (src, hint, w, wh) in enumerate(rows):
        p = EnvProgram(src, hint, "arithmetic")
        mem.propose(p)
        mem.set_validation(p.content_hash, True)
        mem.record_evaluation(p.content_hash, i, w, wh, 8, 8)
    return mem


def test_contract_is_quoted_from_the_docs() -> None:
    contract = load_contract()
    assert contract.startswith("```python\nimport random") and "Only the standard library may be imported" in contract
    assert contract in DOCS.read_text() and "Beside the source" not in contract


def test_contract_ships_with_the_package_as_the_docs_file() -> None:
    from spade_mega.curriculum.prompts import CONTRACT_FILE

    assert CONTRACT_FILE.resolve() == DOCS.resolve()  # a symlink in the tree, a copy in a wheel


def test_missing_contract_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match="contract not found"):
        load_contract(tmp_path / "nope.md")
    (tmp_path / "x.md").write_text("no code here")
    with pytest.raises(PromptError, match="cannot find the contract"):
        load_contract(tmp_path / "x.md")


def test_designer_prompt_holds_skill_document_contract_memory_and_format(builder, tmp_path: Path) -> None:
    mem = seeded_memory(tmp_path)
    doc = GroundingDocument("builtin:maths:00003", "maths", "Euclid's algorithm finds the gcd.", 9, False)
    seeds, negatives = mem.seeds("arithmetic", 2, window=200), mem.negatives("arithmetic", 4, window=200)
    prompt = builder.designer("arithmetic", doc, seeds, negatives)
    system, user = prompt.messages
    assert system["role"] == "system" and user["role"] == "user"
    content = user["content"]
    assert "**arithmetic** (arithmetic and algebra" in content
    assert "<document>\nEuclid's algorithm finds the gcd.\n</document>" in content and "builtin:maths:00003" in content
    assert load_contract() in content
    assert "<hint>bisect the range</hint>" in content and "helps by 0.70" in content
    assert "- GuessNumber: Guess a secret" not in content  # the seed is not listed as a negative
    assert "Easy: Trivially guess" in content and "mastered" in content
    assert "Wall: Walk through a wall. (unsolvable" in content
    assert content.rstrip().endswith("```") and "<skill>arithmetic</skill>" in content
    # Rendered through the tokenizer's chat template (ChatML), with the assistant turn opened.
    assert prompt.text.startswith("<|im_start|>system\n") and prompt.text.endswith("<|im_start|>assistant\n")
    mem.close()


def test_an_answer_in_the_requested_format_parses(builder) -> None:
    prompt = builder.designer("logic", None)
    assert "<document>" not in prompt.messages[1]["content"]
    example = load_contract().split("```python\n")[1].split("```")[0]
    answer = f"<skill>logic</skill>\n<hint>halve the interval</hint>\n```python\n{example}```"
    program = parse_designer_output(answer, builder.skills.names, expected_skill="logic")
    assert "class GuessNumber" in program.source


def test_agent_and_hint_play_prompts(builder) -> None:
    plain = builder.agent(["obs 0", "obs 1"], ["go left"])
    assert [m["role"] for m in plain.messages] == ["system", "user", "assistant", "user"]
    assert plain.messages[2]["content"] == "<action>go left</action>" and "<hint>" not in plain.text
    hinted = builder.hint_play(["obs 0"], [], hint="always go right")
    assert "<hint>always go right</hint>" in hinted.messages[0]["content"]
    assert hinted.text.endswith("<|im_start|>assistant\n")
    with pytest.raises(PromptError, match="one more observation than actions"):
        builder.agent(["a"], ["x", "y"])


def test_plain_fallback_without_a_chat_template() -> None:
    text = render(NoTemplate(), [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "System:\nS\n\nUser:\nU\n\nAssistant:\n"
    builder = PromptBuilder(SkillRegistry.from_config(load_config().curriculum), NoTemplate(), contract="C")
    assert builder.agent(["o"]).text.endswith("User:\no\n\nAssistant:\n")


def test_a_seed_whose_source_holds_fences_is_shown_as_one_intact_code_block(builder, tmp_path: Path) -> None:
    # A seed program whose docstring quotes a ``` block must not end the example's fence early: the designer would see
    # a broken example (half a program, then stray code) and copy the breakage.
    from spade_mega.curriculum.parsing import _code_blocks

    source = ('class Quiz:\n    """Reply like this:\n```\nguess 3\n```\n"""\n\n    def reset(self, seed):\n'
              '        return "guess"\n\n    def step(self, a):\n        return "", 1.0, True, False, {}\n')
    with EnvMemory(tmp_path / "m.sqlite") as mem:
        p = EnvProgram(source, "guess 3", "logic")
        mem.propose(p)
        mem.set_validation(p.content_hash, True)
        mem.record_evaluation(p.content_hash, 0, 0.1, 0.9, 8, 8)
        content = builder.designer("logic", None, mem.seeds("logic", 1)).messages[1]["content"]
    blocks, _, closed = _code_blocks(content)
    assert closed and ("python", source) in blocks
