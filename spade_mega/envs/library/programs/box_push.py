"""Push a box onto its target in a small warehouse (one-box Sokoban): plan before you push."""

import random
from collections import deque

# difficulty (rendered by the library; each range reads easy..hard)
SIZE = 6  # 5..8: side of the room including its outer wall
WALLS = 0.1  # 0.0..0.2: fraction of inner cells that are walls
MIN_PUSHES = 2  # 1..6: the box needs at least this many pushes
# end difficulty

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _search(grid, player, box, target):
    """Fewest moves (and the pushes among them) to bring the box to the target, or None."""
    start = (player, box)
    seen = {start: (0, 0)}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        (pr, pc), (br, bc) = state
        moves, pushes = seen[state]
        if (br, bc) == target:
            return moves, pushes
        for dr, dc in MOVES.values():
            np_ = (pr + dr, pc + dc)
            if grid[np_[0]][np_[1]] == "#":
                continue
            nb, push = (br, bc), 0
            if np_ == (br, bc):
                nb, push = (br + dr, bc + dc), 1
                if grid[nb[0]][nb[1]] == "#":
                    continue
            if (np_, nb) not in seen:
                seen[(np_, nb)] = (moves + 1, pushes + push)
                queue.append((np_, nb))
    return None


class BoxPush:
    max_turns = 8 * SIZE

    def reset(self, seed):
        rng = random.Random(seed)
        inner = [(r, c) for r in range(1, SIZE - 1) for c in range(1, SIZE - 1)]
        best = None
        for _ in range(100):  # bounded: if the room cannot need MIN_PUSHES, the most pushes found are used
            grid = [["#" if r in (0, SIZE - 1) or c in (0, SIZE - 1) or rng.random() < WALLS else "."
                     for c in range(SIZE)] for r in range(SIZE)]
            free = [cell for cell in inner if grid[cell[0]][cell[1]] == "."]
            if len(free) < 3:
                continue
            player, box, target = rng.sample(free, 3)
            plan = _search(grid, player, box, target)
            if plan is None or plan[0] > self.max_turns // 2:
                continue
            if best is None or plan[1] > best[0]:
                best = (plan[1], plan[0], grid, player, box, target)
            if plan[1] >= MIN_PUSHES:
                break
        _, self.shortest, self.grid, self.player, self.box, self.target = best
        self.turn = 0
        self.done = False
        return ("Push the box B onto the target T. You are P ('+' when you stand on T); '#' is a wall, '.' is "
                "floor. Walking into the box pushes it one cell if the cell behind it is free; you cannot pull "
                "it. Row 0 is the top.\n"
                f"Reply with one move: up, down, left or right. You have {self.max_turns} moves.\n{self._render()}")

    def _render(self):
        rows = [row[:] for row in self.grid]
        rows[self.target[0]][self.target[1]] = "T"
        rows[self.box[0]][self.box[1]] = "B"
        rows[self.player[0]][self.player[1]] = "+" if self.player == self.target else "P"
        return "\n".join("".join(row) for row in rows)

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.turn += 1
        move = MOVES.get(action.strip().lower().rstrip("."))
        note = "Unknown move; reply up, down, left or right."
        if move is not None:
            nxt = (self.player[0] + move[0], self.player[1] + move[1])
            beyond = (nxt[0] + move[0], nxt[1] + move[1])
            if self.grid[nxt[0]][nxt[1]] == "#":
                note = "You bumped into a wall."
            elif nxt == self.box and self.grid[beyond[0]][beyond[1]] == "#":
                note = "The box will not move: a wall is behind it."
            else:
                if nxt == self.box:
                    self.box = beyond
                    note = f"You pushed the box {action.strip().lower()}."
                else:
                    note = f"You moved {action.strip().lower()}."
                self.player = nxt
        if self.box == self.target:
            self.done = True
            return (f"The box is on the target after {self.turn} moves (shortest: {self.shortest}).",
                    min(1.0, self.shortest / self.turn), True, False, {"moves": self.turn})
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return f"{note}\n{self._render()}", 0.0, False, truncated, {}
