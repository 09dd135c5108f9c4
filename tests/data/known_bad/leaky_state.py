# expect: nondeterministic_episode
# Module-level state survives from one episode to the next inside a worker.
PLAYED = []


class Memory:
    max_turns = 3

    def reset(self, seed):
        self.turn = 0
        return "Say something."

    def step(self, action):
        self.turn += 1
        PLAYED.append(action)
        return f"I have heard {len(PLAYED)} things so far.", 0.0, False, self.turn >= self.max_turns, {}
