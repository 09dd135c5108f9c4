"""A one-turn environment a random policy sometimes wins: the reply must start with an ASCII letter or digit.

examples/configs/tiny_learn.yaml trains the tiny random model on it alone (agent-only, the designer off). A random
byte-level model opens with such a character about a fifth of the time, so GRPO groups hold wins and losses from the
first rollout, and the win rate shows whether the policy improves: the check that RL through the stack learns.
"""


class FirstChar:
    max_turns = 1

    def reset(self, seed):
        return "Reply with a word or a number."

    def step(self, action):
        text = action.strip()
        won = bool(text) and text[0].isascii() and text[0].isalnum()
        verdict = "Accepted." if won else "Rejected: start with a letter or a digit."
        return verdict, 1.0 if won else 0.0, True, False, {}
