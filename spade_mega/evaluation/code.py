"""The ``code`` scorer (LiveCodeBench-style stdin/stdout problems): the completion's last fenced code block is run on
every test case of its item, in sandbox workers, never in this process.

Each candidate program travels inside a small environment program (the contract every sandbox worker runs): one
``step(str(i))`` runs test ``i``, the candidate executed as ``__main__`` with the test's input as standard input
(``sys.stdin``, its buffer, and ``open(0)``); the step's observation is a digest of the printed output's tokens
(whitespace and line breaks aside), and this process compares it with the expected output's: the expected outputs
never enter the worker, so a program cannot find and print them (they were readable there from the runner's frame).
Every test is one call, so each has ``sandbox.call_timeout_s``; a timeout, a crash, a wrong answer or a program that
kills its worker fails the item, and the first failure ends its run. Functional (LeetCode-style, call-a-method) tests
are not supported: convert them to stdin/stdout first.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional, Sequence

from spade_mega.config.errors import ConfigError
from spade_mega.envs.program import EnvProgram
from spade_mega.envs.sandbox import SandboxError, SandboxPool

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# runs inside the sandbox worker; SOLUTION and INPUTS are literals written in by tests_program()
_RUNNER = '''
import builtins
import hashlib
import io
import sys

SOLUTION = {solution!r}
INPUTS = {inputs!r}


class CodeTests:
    """Step i runs the candidate program on test input i; the observation is the digest of its output's tokens."""

    max_turns = {count}

    def reset(self, seed):
        return f"{{len(INPUTS)}} test cases"

    def step(self, action):
        data = INPUTS[int(action)].encode()

        def open_stdin(file, mode="r", *args, **kwargs):  # open(0).read(): stdin, as competitive programmers read it
            if type(file) is int and file == 0:
                return io.BytesIO(data) if "b" in mode else io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
            return builtins.open(file, mode, *args, **kwargs)

        stdin, stdout = sys.stdin, sys.stdout
        sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
        sys.stdout = out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        outcome = "ok"
        try:
            exec(compile(SOLUTION, "<solution>", "exec"),
                 {{"__name__": "__main__", "__builtins__": dict(vars(builtins), open=open_stdin)}})
        except SystemExit:
            pass
        except BaseException as exc:
            outcome = type(exc).__name__
        finally:
            sys.stdin, sys.stdout = stdin, stdout
        out.flush()
        if outcome != "ok":
            return f"failed: {{outcome}}", 0.0, True, False, {{}}
        tokens = " ".join(out.buffer.getvalue().decode("utf-8", "replace").split())
        digest = hashlib.sha256(tokens.encode("utf-8", "replace")).hexdigest()
        return digest, 0.0, int(action) == len(INPUTS) - 1, False, {{}}
'''


def extract_code(reply: str) -> Optional[str]:
    """The last fenced code block (```python, ```py or bare ```) of a reply; None when it has none."""
    blocks = _FENCE.findall(reply)
    return blocks[-1] if blocks else None


def parse_tests(value: Any, setting: str, location: str) -> list[tuple[str, str]]:
    """An item's test cases as (input, expected output) pairs, from a list (or a JSON text of a list) of objects
    with ``input`` and ``output`` (LiveCodeBench's ``public_test_cases`` shape)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(setting, f"{location}: the test cases are not JSON ({exc.msg})") from None
    if not isinstance(value, list) or not value:
        raise ConfigError(setting, f"{location}: the code scorer needs a non-empty list of test cases "
                                   f"({{\"input\": ..., \"output\": ...}}), got {value!r}"[:400])
    tests = []
    for case in value:
        if not isinstance(case, dict) or not isinstance(case.get("input"), str) \
                or not isinstance(case.get("output"), str):
            raise ConfigError(setting, f"{location}: each test case needs text 'input' and 'output', got "
                                       f"{case!r}"[:400])
        if case.get("testtype", "stdin") != "stdin":
            raise ConfigError(setting, f"{location}: test type {case['testtype']!r} is not supported (stdin/stdout "
                                       "tests only: convert functional tests first)")
        tests.append((case["input"], case["output"]))
    return tests


def output_digest(output: str) -> str:
    """What the runner reports of a printed output: the SHA-256 of its tokens joined by single spaces."""
    return hashlib.sha256(" ".join(output.split()).encode("utf-8", "replace")).hexdigest()


def tests_program(solution: str, inputs: Sequence[str]) -> EnvProgram:
    """The environment program that runs ``solution`` on each of ``inputs`` inside a sandbox worker."""
    source = _RUNNER.format(solution=solution, inputs=list(inputs), count=len(inputs))
    return EnvProgram(source, "", "code_tracing", {"origin": "evaluation"})


def run_tests(pool: SandboxPool, solutions: Sequence[Optional[str]], tests: Sequence[Sequence[tuple[str, str]]],
              width: int) -> list[bool]:
    """Whether each solution passes every test of its item; None (nothing extracted) fails. Up to ``width`` run at
    once, each in its own worker, all stepping through their tests together."""
    passed = [False] * len(solutions)
    todo = [i for i, code in enumerate(solutions) if code is not None]
    for start in range(0, len(todo), width):
        handles = {}
        try:
            for i in todo[start:start + width]:
                inputs = [case[0] for case in tests[i]]
                try:
                    handles[i] = pool.open(tests_program(solutions[i], inputs))  # type: ignore[arg-type]
                except SandboxError:
                    continue  # the wrapper holds only literals: a load failure is the worker's, and fails the item
            live = [i for i, reset in zip(handles, pool.reset_many([(h, 0) for h in handles.values()]))
                    if not isinstance(reset, SandboxError)]
            done = dict.fromkeys(live, 0)
            while live:
                steps = pool.step_many([(handles[i], str(done[i])) for i in live])
                going = []
                for i, step in zip(live, steps):
                    if isinstance(step, SandboxError) or step.observation != output_digest(tests[i][done[i]][1]):
                        continue
                    done[i] += 1
                    if done[i] == len(tests[i]):
                        passed[i] = True
                    else:
                        going.append(i)
                live = going
        finally:
            for handle in handles.values():
                handle.close()
    return passed
