"""Run a stack machine by hand: after each chunk of instructions, report the whole stack."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
CHUNKS = 3  # 2..6: chunks of instructions (one per turn)
CHUNK_SIZE = 3  # 2..6: instructions per chunk
OPS = 6  # 4..9: instruction kinds in play (PUSH, ADD, DUP, SUB, SWAP, POP, MUL, OVER, ROT)
# end difficulty

KINDS = ["PUSH", "ADD", "DUP", "SUB", "SWAP", "POP", "MUL", "OVER", "ROT"][:OPS]
NEEDS = {"PUSH": 0, "ADD": 2, "DUP": 1, "SUB": 2, "SWAP": 2, "POP": 1, "MUL": 2, "OVER": 2, "ROT": 3}


def _apply(stack, op):
    kind = op.split()[0]
    if kind == "PUSH":
        stack.append(int(op.split()[1]))
    elif kind == "POP":
        stack.pop()
    elif kind == "DUP":
        stack.append(stack[-1])
    elif kind == "OVER":
        stack.append(stack[-2])
    elif kind == "SWAP":
        stack[-1], stack[-2] = stack[-2], stack[-1]
    elif kind == "ROT":
        stack.append(stack.pop(-3))
    else:
        b, a = stack.pop(), stack.pop()
        stack.append({"ADD": a + b, "SUB": a - b, "MUL": a * b}[kind])


class StackMachine:
    max_turns = CHUNKS

    def reset(self, seed):
        rng = random.Random(seed)
        stack, self.chunks, self.stacks = [], [], []
        for _ in range(CHUNKS):
            chunk = []
            while len(chunk) < CHUNK_SIZE:
                kind = rng.choice(KINDS)
                if len(stack) < NEEDS[kind] or (kind in ("PUSH", "DUP", "OVER") and len(stack) >= 6):
                    continue
                op = f"PUSH {rng.randint(-9, 20)}" if kind == "PUSH" else kind
                trial = stack[:]
                _apply(trial, op)
                if trial and abs(trial[-1]) > 500:
                    continue
                stack = trial
                chunk.append(op)
            self.chunks.append(chunk)
            self.stacks.append(stack[:])
        self.turn = 0
        self.done = False
        return ("A stack machine starts with an empty stack. PUSH n puts n on top; POP drops the top; DUP copies "
                "the top; OVER copies the second item onto the top; SWAP exchanges the top two; ROT moves the "
                "third item to the top; ADD, SUB and MUL pop the top (b) and then the next (a) and push a+b, a-b, "
                f"a*b. After each chunk, reply with the whole stack from bottom to top, like [3, -1, 7] "
                f"([] if empty).\n{self._chunk()}")

    def _chunk(self):
        return f"Chunk {self.turn + 1} of {CHUNKS}: " + "; ".join(self.chunks[self.turn])

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        truth = self.stacks[self.turn]
        self.turn += 1
        try:
            inner = action.strip().strip("[]").replace(",", " ").split()
            ok = [int(v) for v in inner] == truth
        except ValueError:
            ok = False
        verdict = "Correct." if ok else f"Wrong: the stack is {truth}."
        reward = 1.0 / CHUNKS if ok else 0.0
        if self.turn == CHUNKS:
            self.done = True
            return verdict + " That was the last chunk.", reward, True, False, {}
        return f"{verdict}\n{self._chunk()}", reward, False, False, {}
