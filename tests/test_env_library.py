"""The reference library as text: registry, difficulty rendering, program shape, policies, docs (no sandbox).

Programs are only parsed here (``ast.parse`` builds a tree, it runs nothing); playing them is in
test_env_library_sandbox.py, through real sandbox workers.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from spade_mega.envs import library
from spade_mega.envs.library import LibraryError, RandomPolicy, ScriptedPolicy
from spade_mega.envs.library.entry import parse_difficulty_block, render_difficulty_block
from spade_mega.errors import SpadeError

ENTRIES = library.entries()
DOCS = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def test_registry_has_at_least_four_environments_per_skill() -> None:
    assert library.SKILLS == ("arithmetic", "logic", "navigation", "science", "code_tracing", "tool_use")
    assert len(ENTRIES) >= 24
    assert len(set(library.names())) == len(ENTRIES)
    for skill in library.SKILLS:
        found = library.by_skill(skill)
        assert len(found) >= 4, skill
        assert all(e.skill == skill for e in found)
        assert library.entries(skill) == found
    assert library.get("grid_maze").skill == "navigation"


def test_registry_errors_name_what_exists() -> None:
    with pytest.raises(LibraryError, match="no library environment 'nope'; known: running_total"):
        library.get("nope")
    with pytest.raises(SpadeError, match="unknown skill 'poetry'; the library has arithmetic, logic"):
        library.by_skill("poetry")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_entry_program_obeys_the_contract_statically(entry: library.LibraryEntry) -> None:
    assert entry.hint.strip() and entry.summary.strip() and entry.action_examples
    assert 0.0 < entry.target_return <= 1.0
    assert entry.difficulty, "every entry has difficulty parameters"
    assert entry.source() == entry.template, "the shipped file is the program at its default difficulty"
    for level in (0.0, 1.0):
        tree = ast.parse(entry.source(level=level))
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        assert len(classes) == 1, "exactly one environment class"
        methods = {node.name for node in classes[0].body if isinstance(node, ast.FunctionDef)}
        assert {"reset", "step"} <= methods
        assert any(isinstance(node, ast.Assign) and node.targets[0].id == "max_turns"  # type: ignore[attr-defined]
                   for node in classes[0].body)
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_levels_span_every_parameter_from_easy_to_hard(entry: library.LibraryEntry) -> None:
    easy, hard = entry.resolve(level=0.0), entry.resolve(level=1.0)
    assert easy == {n: p.easy for n, p in entry.difficulty.items()}
    assert hard == {n: p.hard for n, p in entry.difficulty.items()}
    assert entry.source(level=0.0) != entry.source(level=1.0)
    for name, value in easy.items():
        assert f"\n{name} = {value!r}  # " in entry.source(level=0.0)


def test_program_record_carries_hint_skill_and_provenance() -> None:
    entry = library.get("grid_maze")
    program = library.render("grid_maze", {"SIZE": 9})
    assert program.hint == entry.hint and program.skill == "navigation"
    assert program.provenance == {"origin": "library", "name": "grid_maze",
                                  "difficulty": {"SIZE": 9, "WALLS": 0.25, "MIN_DISTANCE": 6}}
    assert "\nSIZE = 9  # 5..12: side of the square grid\n" in program.source
    assert program.content_hash == library.render("grid_maze", {"SIZE": 9}).content_hash
    assert program.content_hash != entry.program().content_hash
    mid = entry.program({"SIZE": 6}, level=0.5)  # explicit values win over the level
    assert mid.provenance["difficulty"] == {"SIZE": 6, "WALLS": 0.25, "MIN_DISTANCE": 9}


def test_level_interpolation_rounds_integers_and_keeps_floats() -> None:
    params = library.get("grid_maze").difficulty
    assert params["SIZE"].at_level(0.5) == 8 and isinstance(params["SIZE"].at_level(0.5), int)  # 8.5, half to even
    assert params["WALLS"].at_level(0.5) == 0.25
    projectile = library.get("projectile").difficulty["TOLERANCE"]  # a range that falls from easy to hard
    assert (projectile.low, projectile.high) == (0.005, 0.03)
    assert projectile.at_level(1.0) == 0.005


@pytest.mark.parametrize("override, message", [
    ({"SIZE": 40}, r"grid_maze\.difficulty\.SIZE: must be in 5\.\.12, got 40"),
    ({"SIZE": 7.5}, r"grid_maze\.difficulty\.SIZE: must be an integer in 5\.\.12, got 7\.5"),
    ({"SIZE": True}, r"must be an integer"),
    ({"WALLS": "lots"}, r"grid_maze\.difficulty\.WALLS: must be a number in 0\.15\.\.0\.35"),
    ({"WIDTH": 5}, r"grid_maze\.difficulty\.WIDTH: unknown parameter; grid_maze has SIZE, WALLS, MIN_DISTANCE"),
])
def test_bad_difficulty_is_refused_with_the_parameter_and_range(override: dict, message: str) -> None:
    with pytest.raises(LibraryError, match=message):
        library.render("grid_maze", override)


def test_level_out_of_range_is_refused() -> None:
    with pytest.raises(LibraryError, match=r"level must be in \[0, 1\]"):
        library.get("mastermind").program(level=1.5)


def test_decimal_parameter_accepts_an_integer() -> None:
    program = library.render("box_push", {"WALLS": 0})
    assert "\nWALLS = 0.0  # " in program.source and program.provenance["difficulty"]["WALLS"] == 0.0


BLOCK = ("import random\n\n# difficulty (rendered by the library; each range reads easy..hard)\n"
         "{lines}\n# end difficulty\n\nclass X:\n    max_turns = N\n")


@pytest.mark.parametrize("lines, message", [
    ("N = 3  # 1..5 the colon is missing", "bad difficulty line"),
    ("N = 3  # 1..5.0: mixed", "mixes integers and decimals"),
    ("N = 9  # 1..5: out of its own range", r"N: must be in 1\.\.5, got 9"),
])
def test_malformed_difficulty_blocks_are_reported(lines: str, message: str) -> None:
    with pytest.raises(LibraryError, match=message):
        parse_difficulty_block(BLOCK.format(lines=lines), "test.py")
    with pytest.raises(LibraryError, match="declares no parameters"):
        parse_difficulty_block(BLOCK.replace("{lines}\n", ""), "test.py")
    with pytest.raises(LibraryError, match="no difficulty block"):
        parse_difficulty_block("class X:\n    max_turns = 1\n", "test.py")


def test_render_rewrites_only_the_block() -> None:
    source = BLOCK.format(lines="N = 3  # 1..5: turns\nR = 0.5  # 0.9..0.1: rate") + "N = 3  # 1..5: turns\n"
    assert set(parse_difficulty_block(source, "t")) == {"N", "R"}
    out = render_difficulty_block(source, {"N": 4})
    assert out.count("N = 4  # 1..5: turns") == 1 and out.endswith("N = 3  # 1..5: turns\n")
    assert "R = 0.5  # 0.9..0.1: rate" in out


def test_scripted_policy_feeds_observations_and_reports_a_finished_script() -> None:
    def script(first: str):
        seen = yield f"a:{first}"
        yield f"b:{seen}"

    policy = ScriptedPolicy(script)
    assert policy("start") == "a:start"
    assert policy("next") == "b:next"
    with pytest.raises(RuntimeError, match="oracle script .*script ended while the episode goes on"):
        policy("more")


def test_random_policy_is_reproducible_and_fills_templates_from_the_observation() -> None:
    obs = "Coins 4 and 9 are on the left pan."
    templates = ["weigh {int} vs {int}", "answer {word}"]
    first, again = RandomPolicy(templates, seed=3), RandomPolicy(templates, seed=3)
    assert [first(obs) for _ in range(20)] == [again(obs) for _ in range(20)]
    policy = RandomPolicy(templates, seed=0)
    actions = [policy(obs) for _ in range(300)]
    assert not any("{" in a and "}" in a and ("int" in a or "word" in a) for a in actions)
    assert any(re.fullmatch(r"weigh -?\d+ vs -?\d+", a) for a in actions)
    assert any(a.startswith("answer ") and a[len("answer "):] in obs.split() for a in actions)
    assert len(set(actions)) > 50


def test_docs_list_every_library_environment() -> None:
    text = DOCS.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)` \| (\w+) \|", text, re.M))
    assert rows == {e.name: e.skill for e in ENTRIES}
