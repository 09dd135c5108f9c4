"""Find the exit of a maze you can only see one cell around you: explore, remember, and replan."""

import random
from collections import deque

# difficulty (rendered by the library; each range reads easy..hard)
SIZE = 7  # 5..11: side of the square grid
WALLS = 0.25  # 0.15..0.35: fraction of cells that are walls
MIN_DISTANCE = 6  # 4..12: shortest path length from start to exit at least
# end difficulty

MOVES = {"north": (-1, 0), "south": (1, 0), "west": (0, -1), "east": (0, 1)}


class FogMaze:
    max_turns = 6 * SIZE

    def reset(self, seed):
        rng = random.Random(seed)
        cells = [(r, c) for r in range(SIZE) for c in range(SIZE)]
        best = None
        for _ in range(100):  # bounded: if the grid cannot give MIN_DISTANCE, the farthest exit found is used
            self.walls = [[rng.random() < WALLS for _ in range(SIZE)] for _ in range(SIZE)]
            self.pos = rng.choice(cells)
            self.walls[self.pos[0]][self.pos[1]] = False
            dist = {self.pos: 0}
            queue = deque([self.pos])
            while queue:
                r, c = queue.popleft()
                for dr, dc in MOVES.values():
                    n = (r + dr, c + dc)
                    if self._open(n) and n not in dist:
                        dist[n] = dist[(r, c)] + 1
                        queue.append(n)
            reach = [(d, cell) for cell, d in sorted(dist.items()) if 0 < d <= 2 * SIZE]
            far = [cell for d, cell in reach if d >= MIN_DISTANCE]
            if reach:
                goal = rng.choice(far) if far else max(reach)[1]
                if best is None or dist[goal] > best[0]:
                    best = (dist[goal], self.walls, self.pos, goal)
            if far:
                break
        _, self.walls, self.pos, self.exit = best
        self.turn = 0
        self.done = False
        return (f"You are in a dark {SIZE}x{SIZE} maze; rows grow southward, columns eastward, both from 0. "
                f"Find the exit at row {self.exit[0]}, column {self.exit[1]}. Outside the grid is solid wall.\n"
                f"Reply with one move: north, south, east or west. You have {self.max_turns} moves.\n{self._look()}")

    def _open(self, cell):
        r, c = cell
        return 0 <= r < SIZE and 0 <= c < SIZE and not self.walls[r][c]

    def _look(self):
        r, c = self.pos
        rows = []
        for dr in (-1, 0, 1):
            rows.append("".join("@" if dr == dc == 0 else ("." if self._open((r + dr, c + dc)) else "#")
                                for dc in (-1, 0, 1)))
        return f"You are at row {r}, column {c}. Around you ('#' wall, '.' open, '@' you):\n" + "\n".join(rows)

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        move = MOVES.get(action.strip().lower().rstrip("."))
        if move is None:
            note = "Unknown move; reply north, south, east or west."
        elif self._open((self.pos[0] + move[0], self.pos[1] + move[1])):
            self.pos = (self.pos[0] + move[0], self.pos[1] + move[1])
            note = f"You walk {action.strip().lower()}."
        else:
            note = "A wall blocks the way."
        if self.pos == self.exit:
            self.done = True
            return f"You found the exit in {self.turn} moves!", 1.0, True, False, {"moves": self.turn}
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return f"{note}\n{self._look()}", 0.0, False, truncated, {}
