"""Hit a target with a cannon at a fixed angle by choosing the launch speed; air drag bends the rules."""

import math
import random

# difficulty (rendered by the library; each range reads easy..hard)
DRAG = 0.002  # 0.0..0.006: quadratic drag coefficient k (1/m): drag acceleration = k * speed * velocity
TOLERANCE = 0.02  # 0.03..0.005: a hit lands within this fraction of the target distance
ATTEMPTS = 4  # 5..3: shots allowed
# end difficulty

PLANETS = [("Earth", 9.81), ("Mars", 3.71), ("the Moon", 1.62)]


def _landing(speed, angle, g):
    """Where the ball comes back to the ground: midpoint integration over ~4000 steps of the flight."""
    dt = 2 * speed * math.sin(angle) / g / 4000  # the drag-free flight time bounds the real one
    x = y = 0.0
    vx, vy = speed * math.cos(angle), speed * math.sin(angle)
    while True:
        s = math.hypot(vx, vy)
        hx, hy = vx - DRAG * s * vx * dt / 2, vy - (g + DRAG * s * vy) * dt / 2
        hs = math.hypot(hx, hy)
        nx, ny = x + hx * dt, y + hy * dt
        vx, vy = vx - DRAG * hs * hx * dt, vy - (g + DRAG * hs * hy) * dt
        if ny < 0.0:
            return x + (nx - x) * y / (y - ny)
        x, y = nx, ny


class Projectile:
    max_turns = ATTEMPTS

    def reset(self, seed):
        rng = random.Random(seed)
        self.planet, self.g = rng.choice(PLANETS)
        self.angle_deg = rng.choice([20, 30, 35, 40, 45, 50, 55, 60, 70])
        self.distance = float(rng.randint(20, 150))
        self.attempt = 0
        self.done = False
        drag = ("There is no air resistance." if DRAG == 0 else
                f"Air drag decelerates the ball by k*|v|*v with k = {DRAG} per metre (against its motion).")
        return (f"A cannon on {self.planet} (g = {self.g} m/s^2) fires at a fixed {self.angle_deg} degrees above "
                f"flat ground. The target is {self.distance:.0f} m away. {drag}\n"
                f"Reply with the launch speed in m/s (a number). A hit lands within {TOLERANCE * 100:g}% of the "
                f"target distance. You have {ATTEMPTS} shots; earlier hits score more.")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.attempt += 1
        try:
            speed = float(action.strip().split()[0].rstrip("m/s,"))
        except (ValueError, IndexError):
            speed = -1.0
        left = ATTEMPTS - self.attempt
        if not 0.0 < speed <= 500.0:
            note = "Reply with a launch speed between 0 and 500 m/s."
        else:
            landed = _landing(speed, math.radians(self.angle_deg), self.g)
            miss = landed - self.distance
            if abs(miss) <= TOLERANCE * self.distance:
                self.done = True
                return (f"Hit! The shot at {speed:g} m/s landed at {landed:.2f} m.",
                        max(0.25, 1.0 - 0.25 * (self.attempt - 1)), True, False, {"shots": self.attempt})
            side = "short of" if miss < 0 else "beyond"
            note = f"The shot at {speed:g} m/s landed at {landed:.2f} m, {abs(miss):.2f} m {side} the target."
        if left == 0:
            self.done = True
            return note + " No shots left.", 0.0, True, False, {"shots": self.attempt}
        return f"{note} Shots left: {left}.", 0.0, False, False, {}
