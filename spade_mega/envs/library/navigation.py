"""Spatial and grid navigation environments and their oracles."""

from __future__ import annotations

import re
from collections import deque
from typing import Callable, Generator, Hashable, Iterable, TypeVar

from spade_mega.envs.library.entry import LibraryEntry

Script = Generator[str, str, None]
State = TypeVar("State", bound=Hashable)
Cell = tuple[int, int]
DELTAS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _first_action(start: State, done: Callable[[State], bool],
                  moves: Callable[[State], Iterable[tuple[str, State]]]) -> str | None:
    """The first action of a shortest plan from ``start`` (breadth-first search), or None if none exists."""
    first: dict[State, str | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if done(state):
            return first[state]
        for action, nxt in moves(state):
            if nxt not in first:
                first[nxt] = first[state] or action
                queue.append(nxt)
    return None


def _map(obs: str, marks: str) -> tuple[list[str], dict[str, Cell]]:
    """The grid drawn in ``obs`` (rows of '#', '.' and ``marks``) and where each mark is."""
    rows = re.findall(rf"^[#.{re.escape(marks)}]+$", obs, re.M)
    found = {m: (r, row.index(m)) for r, row in enumerate(rows) for m in marks if m in row}
    return rows, found


def _free(rows: list[str], cell: Cell) -> bool:
    r, c = cell
    return 0 <= r < len(rows) and 0 <= c < len(rows[r]) and rows[r][c] != "#"


def grid_maze_oracle(obs: str) -> Script:
    while True:
        rows, marks = _map(obs, "AG")
        goal = marks["G"]
        obs = yield _first_action(
            marks["A"], lambda cell: cell == goal,
            lambda cell: [(a, (cell[0] + d[0], cell[1] + d[1])) for a, d in DELTAS.items()
                          if _free(rows, (cell[0] + d[0], cell[1] + d[1]))])


def fog_maze_oracle(obs: str) -> Script:
    """Optimistic exploration: unknown cells count as open; remember walls seen, replan every move."""
    size = int(re.search(r"dark (\d+)x", obs)[1])
    goal = tuple(map(int, re.search(r"exit at row (\d+), column (\d+)", obs).groups()))
    walls: set[Cell] = set()
    compass = {"north": (-1, 0), "south": (1, 0), "west": (0, -1), "east": (0, 1)}
    while True:
        r, c = map(int, re.findall(r"You are at row (\d+), column (\d+)", obs)[-1])
        view = re.findall(r"^[#.@]{3}$", obs, re.M)[-3:]
        for dr in (-1, 0, 1):
            for dc in (-1, 0, 1):
                if view[dr + 1][dc + 1] == "#":
                    walls.add((r + dr, c + dc))

        def moves(cell: Cell) -> list[tuple[str, Cell]]:
            out = []
            for action, (dr, dc) in compass.items():
                n = (cell[0] + dr, cell[1] + dc)
                if 0 <= n[0] < size and 0 <= n[1] < size and n not in walls:
                    out.append((action, n))
            return out

        obs = yield _first_action((r, c), lambda cell: cell == goal, moves)


def box_push_oracle(obs: str) -> Script:
    """Breadth-first search over (player, box) positions, replanned from every new map."""
    while True:
        rows, marks = _map(obs, "PBT+")
        player, target = marks.get("P", marks.get("+")), marks.get("T", marks.get("+"))

        def moves(state: tuple[Cell, Cell]) -> list[tuple[str, tuple[Cell, Cell]]]:
            player, box = state
            out = []
            for action, (dr, dc) in DELTAS.items():
                nxt = (player[0] + dr, player[1] + dc)
                if not _free(rows, nxt):
                    continue
                if nxt == box:
                    beyond = (box[0] + dr, box[1] + dc)
                    if _free(rows, beyond):
                        out.append((action, (nxt, beyond)))
                else:
                    out.append((action, (nxt, box)))
            return out

        obs = yield _first_action((player, marks["B"]), lambda state: state[1] == target, moves)


def heading_maze_oracle(obs: str) -> Script:
    """Breadth-first search over (cell, heading) with the three egocentric actions."""
    arrows = {"^": (-1, 0), ">": (0, 1), "v": (1, 0), "<": (0, -1)}
    clockwise = "^>v<"
    while True:
        rows, marks = _map(obs, "G^>v<")
        robot = next(m for m in clockwise if m in marks)

        def moves(state: tuple[Cell, str]) -> list[tuple[str, tuple[Cell, str]]]:
            cell, arrow = state
            i = clockwise.index(arrow)
            out = [("turn left", (cell, clockwise[(i + 3) % 4])), ("turn right", (cell, clockwise[(i + 1) % 4]))]
            ahead = (cell[0] + arrows[arrow][0], cell[1] + arrows[arrow][1])
            if _free(rows, ahead):
                out.insert(0, ("forward", (ahead, arrow)))
            return out

        goal = marks["G"]
        obs = yield _first_action((marks[robot], robot), lambda state: state[0] == goal, moves)


ENTRIES = [
    LibraryEntry(
        name="grid_maze",
        skill="navigation",
        summary="shortest-path planning on a fully visible ASCII maze",
        hint="Plan the whole route before moving: do a breadth-first search from A over '.' cells and follow "
             "the shortest path. Rows are counted from the top, so 'down' increases the row and 'right' the column.",
        oracle=grid_maze_oracle,
        target_return=1.0,
        action_examples=("up", "down", "left", "right"),
    ),
    LibraryEntry(
        name="fog_maze",
        skill="navigation",
        summary="exploring a maze under partial observability with a memory of walls seen",
        hint="Keep your own map: record every wall you have seen by its coordinates. Head for the exit as if "
             "unknown cells were open, and replan from your map whenever a wall blocks the way; never walk back "
             "and forth between the same cells.",
        oracle=fog_maze_oracle,
        target_return=1.0,
        action_examples=("north", "south", "east", "west"),
    ),
    LibraryEntry(
        name="box_push",
        skill="navigation",
        summary="Sokoban-style planning: where to stand to push a box, and avoiding dead ends",
        hint="To push the box in a direction you must stand on the opposite side of it, so plan the pushes "
             "first and walk around to each pushing spot. Never push the box into a corner or against a wall "
             "unless the target lies along that wall: you cannot pull it back.",
        oracle=box_push_oracle,
        target_return=1.0,
        action_examples=("up", "down", "left", "right"),
    ),
    LibraryEntry(
        name="heading_maze",
        skill="navigation",
        summary="egocentric control: turning left/right relative to the robot's heading on a map",
        hint="Left and right are relative to the way the robot faces: facing east, 'turn left' makes it face "
             "north; facing south, 'turn left' makes it face east. Turn first, then go forward; choose the route "
             "with the fewest turns, since every turn costs an action.",
        oracle=heading_maze_oracle,
        target_return=1.0,
        action_examples=("forward", "turn left", "turn right", "forward"),
    ),
]
