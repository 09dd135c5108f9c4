"""Bring a room to a target temperature and hold it there with a heater whose physics you must first measure."""

import random

# difficulty (rendered by the library; each range reads easy..hard)
TOLERANCE = 0.5  # 0.8..0.3: the room counts as on target within this many degrees
NOISE = 0.05  # 0.0..0.15: standard deviation of random temperature disturbances per turn
TURNS = 12  # 14..10: turns in the episode
HOLD = 3  # 2..4: turns in a row the room must end on target to win
# end difficulty


class Thermostat:
    max_turns = TURNS

    def reset(self, seed):
        rng = random.Random(seed)
        self.rng = rng
        self.outside = float(rng.randint(-5, 12))
        self.target = float(rng.randint(19, 23))
        self.leak = rng.uniform(0.08, 0.25)  # fraction of the inside-outside gap lost per turn
        self.gain = rng.uniform(0.4, 1.2)  # degrees added per turn per unit of heater power
        while self.gain * 10 < 1.3 * self.leak * (self.target - self.outside):
            self.gain *= 1.25  # full power must be able to hold the target with margin
        self.temp = round(self.target - rng.uniform(3.0, 6.0), 2)
        self.turn = 0
        self.streak = 0  # turns in a row that ended on target
        self.done = False
        return (f"You control a room heater for {TURNS} turns. Outside it is {self.outside:g} C; the room is "
                f"{self.temp:.2f} C now. Keep the room at {self.target:g} C (within {TOLERANCE:g} C). Each turn, "
                "reply with a heater power from 0 to 10 (decimals allowed). Each turn the room loses a fixed "
                "fraction of its difference to the outside and gains heat in proportion to the power; you are "
                f"not told either rate. You win when {HOLD} turns in a row end on target.")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        try:
            power = min(10.0, max(0.0, float(action.strip().split()[0])))
            note = ""
        except (ValueError, IndexError):
            power, note = 0.0, "Unreadable power, the heater stays off. "
        before = self.temp
        self.temp = round(self.temp + self.leak * (self.outside - self.temp) + self.gain * power
                          + self.rng.gauss(0.0, NOISE), 2)
        ok = abs(self.temp - self.target) <= TOLERANCE
        self.streak = self.streak + 1 if ok else 0
        won = self.streak >= HOLD
        truncated = not won and self.turn >= TURNS
        self.done = won or truncated
        status = (f"on target, {self.streak} in a row" if ok
                  else ("too cold" if self.temp < self.target else "too warm"))
        ending = (f"The room held {self.target:g} C for {HOLD} turns: you win." if won
                  else f"Turns left: {TURNS - self.turn}.")
        return (f"{note}Turn {self.turn}: power {power:g}, the room went from {before:.2f} C to {self.temp:.2f} C "
                f"({status}; target {self.target:g} C, outside {self.outside:g} C). {ending}",
                1.0 if won else 0.0, won, truncated, {"temperature": self.temp})
