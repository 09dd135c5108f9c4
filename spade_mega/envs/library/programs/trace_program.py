"""Trace a short Python program with loops and branches, then report its variables' final values."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
STATEMENTS = 4  # 3..9: top-level statements after the initial assignments
VARIABLES = 2  # 2..4: variables in play (each is asked for, one per turn)
DEPTH = 1  # 0..2: how deeply loops and ifs may nest
# end difficulty

NAMES = ["a", "b", "c", "d"]
LOOP_VARS = ["i", "j"]


def _simple(rng, names, loop_vars):
    x = rng.choice(names)
    y = rng.choice([n for n in names if n != x])
    kinds = ["add", "sub", "addk", "mod", "copy", "swap"] + (["loopvar", "loopvar"] if loop_vars else ["mul"])
    kind = rng.choice(kinds)
    if kind == "add":
        return f"{x} = {x} + {y}"
    if kind == "sub":
        return f"{x} = {x} - {y}"
    if kind == "addk":
        return f"{x} += {rng.randint(1, 9)}"
    if kind == "mod":
        return f"{x} = {x} % {rng.randint(3, 9)}"
    if kind == "copy":
        return f"{x} = {y} + {rng.randint(0, 5)}"
    if kind == "swap":
        return f"{x}, {y} = {y}, {x}"
    if kind == "mul":
        return f"{x} = {x} * {rng.randint(2, 3)}"
    return f"{x} = {x} + {rng.choice(loop_vars)}"


def _block(rng, names, depth, loop_vars, count):
    lines = []
    for _ in range(count):
        roll = rng.random()
        if depth < DEPTH and roll < 0.3:
            var = LOOP_VARS[len(loop_vars)]
            lines.append(f"for {var} in range({rng.randint(2, 4)}):")
            inner = _block(rng, names, depth + 1, loop_vars + [var], rng.randint(1, 2))
            lines += ["    " + line for line in inner]
        elif depth < DEPTH and roll < 0.55:
            x, y = rng.sample(names, 2)
            lines.append(f"if {x} {rng.choice(['>', '<', '>=', '==', '!='])} {y}:")
            lines += ["    " + line for line in _block(rng, names, depth + 1, loop_vars, rng.randint(1, 2))]
            if rng.random() < 0.5:
                lines.append("else:")
                lines += ["    " + line for line in _block(rng, names, depth + 1, loop_vars, 1)]
        else:
            lines.append(_simple(rng, names, loop_vars))
    return lines


def _run(lines, env):
    """Interpret the generated subset (the environment knows every form it writes)."""
    i = 0
    while i < len(lines):
        line = lines[i]
        body, j = [], i + 1
        while j < len(lines) and lines[j].startswith("    "):
            body.append(lines[j][4:])
            j += 1
        if line.startswith("for "):
            var, count = line[4], int(line[line.index("range(") + 6:line.index(")")])
            for k in range(count):
                env[var] = k
                _run(body, env)
            i = j
        elif line.startswith("if "):
            x, op, y = line[3:-1].split()
            holds = {">": env[x] > env[y], "<": env[x] < env[y], ">=": env[x] >= env[y], "==": env[x] == env[y],
                     "!=": env[x] != env[y]}[op]
            other = []
            if j < len(lines) and lines[j] == "else:":
                j += 1
                while j < len(lines) and lines[j].startswith("    "):
                    other.append(lines[j][4:])
                    j += 1
            _run(body if holds else other, env)
            i = j
        elif " += " in line:
            target, amount = line.split(" += ")
            env[target] += int(amount)
            i += 1
        else:
            target, expr = line.split(" = ")
            if "," in target:
                x, y = target.split(", ")
                env[x], env[y] = env[y], env[x]
            else:
                parts = [env[p] if p in env else (p if p in "+-*%" else int(p)) for p in expr.split()]
                if len(parts) == 1:
                    env[target] = parts[0]
                else:
                    a, op, b = parts
                    env[target] = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a % b
            i += 1


class TraceProgram:
    max_turns = VARIABLES

    def reset(self, seed):
        rng = random.Random(seed)
        names = NAMES[:VARIABLES]
        while True:
            start = [f"{n} = {rng.randint(-5, 12)}" for n in names]
            lines = start + _block(rng, names, 0, [], STATEMENTS)
            env = {}
            _run(lines, env)
            if all(abs(env[n]) <= 999 for n in names):
                break
        self.final = {n: env[n] for n in names}
        self.code = "\n".join(lines)
        self.asked = names[:]
        rng.shuffle(self.asked)
        self.turn = 0
        self.done = False
        return (f"Trace this Python program:\n```python\n{self.code}\n```\nI will ask for the final value of each "
                f"variable, one per turn. Reply with a single integer.\nWhat is the final value of {self.asked[0]}?")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        name = self.asked[self.turn]
        self.turn += 1
        try:
            ok = int(action.strip().split("=")[-1].strip().rstrip(".")) == self.final[name]
        except ValueError:
            ok = False
        verdict = "Correct." if ok else "Wrong."
        reward = 1.0 / VARIABLES if ok else 0.0
        if self.turn == VARIABLES:
            self.done = True
            return verdict + " That was the last question.", reward, True, False, {}
        return f"{verdict} What is the final value of {self.asked[self.turn]}?", reward, False, False, {}
