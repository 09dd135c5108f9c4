"""Drive a robot that can only go forward or turn on the spot: egocentric moves on a map."""

import random
from collections import deque

# difficulty (rendered by the library; each range reads easy..hard)
SIZE = 7  # 5..11: side of the square grid
WALLS = 0.2  # 0.1..0.3: fraction of cells that are walls
MIN_DISTANCE = 5  # 3..12: shortest walk (in cells) from start to goal at least
# end difficulty

HEADINGS = ["north", "east", "south", "west"]
STEP = {"north": (-1, 0), "east": (0, 1), "south": (1, 0), "west": (0, -1)}
ARROWS = {"north": "^", "east": ">", "south": "v", "west": "<"}


class HeadingMaze:
    max_turns = 5 * SIZE

    def reset(self, seed):
        rng = random.Random(seed)
        cells = [(r, c) for r in range(SIZE) for c in range(SIZE)]
        best = None
        for _ in range(100):  # bounded: if the grid cannot give MIN_DISTANCE, the farthest goal found is used
            self.grid = [["#" if rng.random() < WALLS else "." for _ in range(SIZE)] for _ in range(SIZE)]
            self.pos = rng.choice(cells)
            self.heading = rng.choice(HEADINGS)
            self.grid[self.pos[0]][self.pos[1]] = "."
            reach = [(walk, cell, actions) for cell, (actions, walk) in sorted(self._action_distances().items())
                     if 0 < walk and actions <= self.max_turns // 2]
            far = [item for item in reach if item[0] >= MIN_DISTANCE]
            if reach:
                walk, goal, actions = rng.choice(far) if far else max(reach)
                if best is None or walk > best[0]:
                    best = (walk, self.grid, self.pos, self.heading, goal, actions)
            if far:
                break
        _, self.grid, self.pos, self.heading, self.goal, self.shortest = best
        self.turn = 0
        self.done = False
        return ("Drive the robot to the goal G. The robot is the arrow (^ north/up, > east, v south, < west) and "
                "can only do three things: 'forward' (one cell in the direction it faces), 'turn left' or "
                "'turn right' (90 degrees on the spot). '#' is a wall, '.' is floor, north is up.\n"
                f"You have {self.max_turns} actions; the reward is highest for the fewest actions.\n{self._render()}")

    def _open(self, cell):
        return 0 <= cell[0] < SIZE and 0 <= cell[1] < SIZE and self.grid[cell[0]][cell[1]] != "#"

    def _action_distances(self):
        """For each reachable cell: (fewest actions to reach it in any heading, fewest cells walked)."""
        start = (self.pos, self.heading)
        seen = {start: (0, 0)}
        queue = deque([start])
        best = {}
        while queue:
            state = queue.popleft()
            cell, heading = state
            actions, cells = seen[state]
            if cell not in best:
                best[cell] = (actions, cells)
            i = HEADINGS.index(heading)
            options = [(cell, HEADINGS[(i + 1) % 4], cells), (cell, HEADINGS[(i + 3) % 4], cells)]
            ahead = (cell[0] + STEP[heading][0], cell[1] + STEP[heading][1])
            if self._open(ahead):
                options.append((ahead, heading, cells + 1))
            for n_cell, n_heading, n_cells in options:
                if (n_cell, n_heading) not in seen:
                    seen[(n_cell, n_heading)] = (actions + 1, n_cells)
                    queue.append((n_cell, n_heading))
        return best

    def _render(self):
        rows = [row[:] for row in self.grid]
        rows[self.goal[0]][self.goal[1]] = "G"
        rows[self.pos[0]][self.pos[1]] = ARROWS[self.heading]
        return f"The robot faces {self.heading}.\n" + "\n".join("".join(row) for row in rows)

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        words = action.strip().lower().rstrip(".").split()
        i = HEADINGS.index(self.heading)
        if words in (["forward"], ["f"]):
            ahead = (self.pos[0] + STEP[self.heading][0], self.pos[1] + STEP[self.heading][1])
            if self._open(ahead):
                self.pos = ahead
                note = "The robot moves forward."
            else:
                note = "The robot bumps into a wall."
        elif words in (["turn", "left"], ["left"]):
            self.heading = HEADINGS[(i + 3) % 4]
            note = "The robot turns left."
        elif words in (["turn", "right"], ["right"]):
            self.heading = HEADINGS[(i + 1) % 4]
            note = "The robot turns right."
        else:
            note = "Unknown action; reply 'forward', 'turn left' or 'turn right'."
        if self.pos == self.goal:
            self.done = True
            return (f"The robot reached the goal in {self.turn} actions (fewest possible: {self.shortest}).",
                    min(1.0, self.shortest / self.turn), True, False, {"actions": self.turn})
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return f"{note}\n{self._render()}", 0.0, False, truncated, {}
