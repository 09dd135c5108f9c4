# expect: output_limit
# Debug printing left in: far more than the per-call output limit.
class Chatty:
    max_turns = 3

    def reset(self, seed):
        return "Hello."

    def step(self, action):
        for i in range(20_000):
            print(f"debug line {i}: action={action!r}")
        return "ok", 0.0, True, False, {}
