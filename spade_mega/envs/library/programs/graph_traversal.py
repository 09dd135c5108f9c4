"""Graph algorithms by hand on an adjacency list: BFS and DFS orders, distances, components."""

import random
from collections import deque

# difficulty (rendered by the library; each range reads easy..hard)
NODES = 6  # 5..12: nodes, labelled A, B, C, ...
EXTRA_EDGES = 2  # 0..8: edges beyond a spanning forest (more cycles)
QUESTIONS = 3  # 2..4: questions, one per turn
# end difficulty


class GraphTraversal:
    max_turns = QUESTIONS

    def reset(self, seed):
        rng = random.Random(seed)
        nodes = [chr(ord("A") + i) for i in range(NODES)]
        edges = set()
        for i in range(1, NODES):
            if rng.random() < 0.9:  # occasionally a node starts a new component
                edges.add(tuple(sorted((nodes[i], nodes[rng.randrange(i)]))))
        pairs = [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:] if (a, b) not in edges]
        edges.update(rng.sample(pairs, min(EXTRA_EDGES, len(pairs))))
        self.adj = {n: sorted([b for a, b in edges if a == n] + [a for a, b in edges if b == n]) for n in nodes}
        start = rng.choice(nodes)
        reach = self._bfs(start)
        target = rng.choice([n for n in reach if n != start] or [start])
        asks = [(f"the breadth-first search order from {start}", ", ".join(reach)),
                (f"the depth-first search order from {start}", ", ".join(self._dfs(start, []))),
                (f"the number of edges on a shortest path from {start} to {target}",
                 str(self._distance(start, target))),
                ("the number of connected components of the graph", str(self._components(nodes)))]
        rng.shuffle(asks)
        self.asks = asks[:QUESTIONS]
        self.turn = 0
        self.done = False
        lines = "\n".join(f"{n}: {', '.join(self.adj[n]) or '(none)'}" for n in nodes)
        return ("An undirected graph, as adjacency lists (neighbours in alphabetical order):\n" + lines
                + "\nSearches visit neighbours in alphabetical order; the DFS is the recursive one (preorder). "
                "Give orders as comma-separated node names (only nodes reachable from the start), counts as "
                f"integers. {QUESTIONS} questions, one per turn.\nQuestion 1: what is {self.asks[0][0]}?")

    def _bfs(self, start):
        order, queue = [start], deque([start])
        while queue:
            for n in self.adj[queue.popleft()]:
                if n not in order:
                    order.append(n)
                    queue.append(n)
        return order

    def _dfs(self, node, order):
        order.append(node)
        for n in self.adj[node]:
            if n not in order:
                self._dfs(n, order)
        return order

    def _distance(self, start, target):
        dist, queue = {start: 0}, deque([start])
        while queue:
            node = queue.popleft()
            for n in self.adj[node]:
                if n not in dist:
                    dist[n] = dist[node] + 1
                    queue.append(n)
        return dist[target]

    def _components(self, nodes):
        seen, count = [], 0
        for n in nodes:
            if n not in seen:
                count += 1
                seen += self._bfs(n)
        return count

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        question, truth = self.asks[self.turn]
        self.turn += 1
        given = ", ".join(p.strip().upper() for p in action.strip().strip("[].").replace(" ", ",").split(",")
                          if p.strip())
        ok = given == truth
        verdict = "Correct." if ok else f"Wrong: {question} is {truth}."
        reward = 1.0 / QUESTIONS if ok else 0.0
        if self.turn == QUESTIONS:
            self.done = True
            return verdict + " That was the last question.", reward, True, False, {}
        return f"{verdict}\nQuestion {self.turn + 1}: what is {self.asks[self.turn][0]}?", reward, False, False, {}
