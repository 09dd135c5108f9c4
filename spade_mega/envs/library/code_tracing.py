"""Algorithm and code tracing environments and their oracles."""

from __future__ import annotations

import ast
import operator
import re
from collections import deque
from typing import Generator

from spade_mega.envs.library.entry import LibraryEntry

Script = Generator[str, str, None]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod}
_COMPARE = {ast.Gt: operator.gt, ast.Lt: operator.lt, ast.GtE: operator.ge, ast.LtE: operator.le,
            ast.Eq: operator.eq, ast.NotEq: operator.ne}


class _Tracer:
    """A tiny interpreter for straight-line integer Python with for-range loops and if/else.

    The code comes from a sandboxed environment, so it is parsed (``ast.parse`` only builds a tree) and
    interpreted node by node; any construct outside this subset is refused rather than run.
    """

    def __init__(self) -> None:
        self.env: dict[str, int] = {}

    def value(self, node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            return self.env[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](self.value(node.left), self.value(node.right))
        raise ValueError(f"unsupported expression {ast.dump(node)}")

    def run(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple):
                values = [self.value(v) for v in stmt.value.elts]  # type: ignore[attr-defined]
                for target, v in zip(stmt.targets[0].elts, values):
                    self.env[target.id] = v  # type: ignore[attr-defined]
            elif isinstance(stmt, ast.Assign):
                self.env[stmt.targets[0].id] = self.value(stmt.value)  # type: ignore[attr-defined]
            elif isinstance(stmt, ast.AugAssign) and type(stmt.op) in _BINARY:
                name = stmt.target.id  # type: ignore[attr-defined]
                self.env[name] = _BINARY[type(stmt.op)](self.env[name], self.value(stmt.value))
            elif (isinstance(stmt, ast.For) and isinstance(stmt.iter, ast.Call)
                  and isinstance(stmt.iter.func, ast.Name) and stmt.iter.func.id == "range"):
                count = self.value(stmt.iter.args[0])
                if count > 1000:
                    raise ValueError(f"refusing to trace a loop of {count} iterations")
                for i in range(count):
                    self.env[stmt.target.id] = i  # type: ignore[attr-defined]
                    self.run(stmt.body)
            elif isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare):
                test = stmt.test
                holds = _COMPARE[type(test.ops[0])](self.value(test.left), self.value(test.comparators[0]))
                self.run(stmt.body if holds else stmt.orelse)
            else:
                raise ValueError(f"unsupported statement {ast.dump(stmt)}")


def trace_program_oracle(obs: str) -> Script:
    tracer = _Tracer()
    tracer.run(ast.parse(re.search(r"```python\n(.*?)\n```", obs, re.S)[1]).body)
    while True:
        name = re.findall(r"final value of (\w+)\?", obs)[-1]
        obs = yield str(tracer.env[name])


def stack_machine_oracle(obs: str) -> Script:
    stack: list[int] = []
    while True:
        chunk = re.search(r"Chunk \d+ of \d+: (.*)", obs)[1]
        for op in chunk.split("; "):
            kind, *arg = op.split()
            if kind == "PUSH":
                stack.append(int(arg[0]))
            elif kind == "POP":
                stack.pop()
            elif kind in ("DUP", "OVER"):
                stack.append(stack[-1 if kind == "DUP" else -2])
            elif kind == "SWAP":
                stack[-1], stack[-2] = stack[-2], stack[-1]
            elif kind == "ROT":
                stack.append(stack.pop(-3))
            else:
                b, a = stack.pop(), stack.pop()
                stack.append({"ADD": a + b, "SUB": a - b, "MUL": a * b}[kind])
        obs = yield "[" + ", ".join(map(str, stack)) + "]"


def sort_trace_oracle(obs: str) -> Script:
    algorithm = re.match(r"(\w+) sort", obs)[1].lower()
    a = [int(v) for v in re.search(r"The array \(a\[0\] first\) is \[([\d, ]+)\]", obs)[1].split(",")]
    n = len(a)
    for k in range(1, n):
        if algorithm == "bubble":
            for j in range(n - k):
                if a[j] > a[j + 1]:
                    a[j], a[j + 1] = a[j + 1], a[j]
        elif algorithm == "insertion":
            a[:k + 1] = sorted(a[:k + 1])  # pass k leaves a[0..k] sorted and the rest untouched
        else:
            m = min(range(k - 1, n), key=lambda i: (a[i], i))
            a[k - 1], a[m] = a[m], a[k - 1]
        yield str(a)


def graph_traversal_oracle(obs: str) -> Script:
    adj = {n: [] if rest == "(none)" else rest.split(", ") for n, rest in re.findall(r"^([A-Z]): (.*)$", obs, re.M)}

    def bfs(start: str) -> dict[str, int]:
        dist, queue = {start: 0}, deque([start])
        while queue:
            node = queue.popleft()
            for n in adj[node]:
                if n not in dist:
                    dist[n] = dist[node] + 1
                    queue.append(n)
        return dist  # insertion order is the BFS order

    def dfs(node: str, seen: list[str]) -> list[str]:
        seen.append(node)
        for n in adj[node]:
            if n not in seen:
                dfs(n, seen)
        return seen

    while True:
        question = re.findall(r"Question \d+: what is (.*)\?", obs)[-1]
        if m := re.fullmatch(r"the breadth-first search order from (\w)", question):
            answer = ", ".join(bfs(m[1]))
        elif m := re.fullmatch(r"the depth-first search order from (\w)", question):
            answer = ", ".join(dfs(m[1], []))
        elif m := re.fullmatch(r"the number of edges on a shortest path from (\w) to (\w)", question):
            answer = str(bfs(m[1])[m[2]])
        else:
            covered: set[str] = set()
            components = 0
            for node in adj:
                if node not in covered:
                    components += 1
                    covered |= set(bfs(node))
            answer = str(components)
        obs = yield answer


ENTRIES = [
    LibraryEntry(
        name="trace_program",
        skill="code_tracing",
        summary="executing Python by hand: nested for-range loops, if/else, tuple swaps, modulo",
        hint="Keep a table with one column per variable and write a new row after every executed line. "
             "range(k) runs the body k times with the loop variable 0..k-1; 'a, b = b, a' swaps using the old "
             "values; Python's % with a positive divisor never gives a negative result.",
        oracle=trace_program_oracle,
        target_return=1.0,
        action_examples=("{int}", "{int}", "a = {int}"),
    ),
    LibraryEntry(
        name="stack_machine",
        skill="code_tracing",
        summary="simulating a stack machine (PUSH/POP/DUP/OVER/SWAP/ROT/arithmetic) chunk by chunk",
        hint="Write the stack after every single instruction with the top on the right. SUB computes "
             "second-from-top minus top (PUSH 7, PUSH 2, SUB leaves 5); ROT takes the third item from the top "
             "and puts it on top ([1, 2, 3] becomes [2, 3, 1]).",
        oracle=stack_machine_oracle,
        target_return=1.0,
        action_examples=("[{int}, {int}]", "[{int}]", "[]", "[{int}, {int}, {int}]"),
    ),
    LibraryEntry(
        name="sort_trace",
        skill="code_tracing",
        summary="tracing bubble, insertion and selection sort exactly, pass by pass",
        hint="Bubble sort: after pass k the k largest values sit, in order, at the end. Insertion sort: after "
             "pass k the first k+1 entries are the original first k+1 in sorted order and the rest is untouched. "
             "Selection sort: pass k changes at most two positions (k-1 and where the minimum was).",
        oracle=sort_trace_oracle,
        target_return=1.0,
        action_examples=("[{int}, {int}, {int}, {int}, {int}]", "{int} {int} {int} {int}", "[]"),
    ),
    LibraryEntry(
        name="graph_traversal",
        skill="code_tracing",
        summary="breadth-first and depth-first orders, shortest paths and components on adjacency lists",
        hint="BFS: a queue; take the front node and append its unvisited neighbours in alphabetical order, "
             "marking them visited as you append. DFS: from a node, go to its first unvisited neighbour and "
             "recurse; only when all its neighbours are visited return to the node before. The BFS level of a "
             "node is its shortest-path distance.",
        oracle=graph_traversal_oracle,
        target_return=1.0,
        action_examples=("A, B, C, D", "{word}, {word}, {word}", "{int}", "2"),
    ),
]
