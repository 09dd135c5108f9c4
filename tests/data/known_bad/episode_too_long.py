# expect: episode_too_long
# Declares max_turns but never ends an episode.
class Forever:
    max_turns = 5

    def reset(self, seed):
        self.turn = 0
        return "Keep talking."

    def step(self, action):
        self.turn += 1
        return f"Turn {self.turn}.", 0.0, False, False, {}
