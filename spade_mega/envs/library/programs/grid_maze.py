"""Walk through a fully visible maze to the goal; the reward favours the shortest path."""

import random
from collections import deque

# difficulty (rendered by the library; each range reads easy..hard)
SIZE = 7  # 5..12: side of the square grid
WALLS = 0.25  # 0.15..0.35: fraction of cells that are walls
MIN_DISTANCE = 6  # 4..14: shortest path length from start to goal at least
# end difficulty

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _distances(grid, start):
    dist = {start: 0}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < SIZE and 0 <= nxt[1] < SIZE and grid[nxt[0]][nxt[1]] != "#" and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                queue.append(nxt)
    return dist


class GridMaze:
    max_turns = 4 * SIZE

    def reset(self, seed):
        rng = random.Random(seed)
        cells = [(r, c) for r in range(SIZE) for c in range(SIZE)]
        best = None
        for _ in range(100):  # bounded: if the grid cannot give MIN_DISTANCE, the farthest goal found is used
            grid = [["#" if rng.random() < WALLS else "." for _ in range(SIZE)] for _ in range(SIZE)]
            pos = rng.choice(cells)
            grid[pos[0]][pos[1]] = "."
            dist = _distances(grid, pos)
            reach = [(d, cell) for cell, d in sorted(dist.items()) if 0 < d <= self.max_turns // 2]
            far = [cell for d, cell in reach if d >= MIN_DISTANCE]
            if reach:
                goal = rng.choice(far) if far else max(reach)[1]
                if best is None or dist[goal] > best[0]:
                    best = (dist[goal], grid, pos, goal)
            if far:
                break
        self.shortest, self.grid, self.pos, self.goal = best
        self.turn = 0
        self.done = False
        return ("Reach the goal G in this maze. You are A; '#' is a wall, '.' is open floor. Row 0 is the top.\n"
                f"Reply with one move: up, down, left or right. You have {self.max_turns} moves; the reward is "
                f"highest for the shortest path.\n{self._render()}")

    def _render(self):
        rows = [row[:] for row in self.grid]
        rows[self.goal[0]][self.goal[1]] = "G"
        rows[self.pos[0]][self.pos[1]] = "A"
        return "\n".join("".join(row) for row in rows)

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        move = MOVES.get(action.strip().lower().rstrip("."))
        if move is None:
            note = "Unknown move; reply up, down, left or right."
        else:
            r, c = self.pos[0] + move[0], self.pos[1] + move[1]
            if 0 <= r < SIZE and 0 <= c < SIZE and self.grid[r][c] != "#":
                self.pos = (r, c)
                note = f"You moved {action.strip().lower()}."
            else:
                note = "You bumped into a wall."
        if self.pos == self.goal:
            self.done = True
            return (f"You reached the goal in {self.turn} moves (shortest: {self.shortest}).",
                    self.shortest / self.turn, True, False, {"moves": self.turn, "shortest": self.shortest})
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return f"{note}\n{self._render()}", 0.0, False, truncated, {}
