"""Mock file-system API: walk a directory tree, count ERROR lines in the log files, write a report."""

import json
import random

# difficulty (rendered by the library; each range reads easy..hard)
DEPTH = 1  # 1..3: folder nesting depth under /logs
FILES = 3  # 3..8: .log files to count
DECOYS = 1  # 0..4: other files that also mention ERROR (.txt notes, .log.bak copies)
# end difficulty

FOLDERS = ["app", "db", "web", "worker", "cron", "auth"]
MESSAGES = ["request served", "cache miss", "user login", "job started", "retry after ERROR", "disk 71% full",
            "connection reset", "config reloaded"]
TOOLS = """Tools (reply with exactly one JSON object per turn, like {"tool": "ls", "args": {"path": "/logs"}}):
- ls {"path": str} -> {"path", "entries": [names; folders end with "/"]}
- read {"path": str} -> {"path", "content"}
- write {"path": str, "content": str} -> {"written"}
- finish {} -> ends the task"""


def _call(action):
    text = action.strip()
    text = text[text.find("{"):text.rfind("}") + 1]
    try:
        call = json.loads(text)
    except ValueError:
        return None, None
    if not (isinstance(call, dict) and isinstance(call.get("tool"), str) and isinstance(call.get("args", {}), dict)):
        return None, None
    return call["tool"], call.get("args", {})


def _log(rng):
    lines = []
    for _ in range(rng.randint(4, 9)):
        level = rng.choice(["INFO", "INFO", "WARN", "ERROR", "DEBUG"])
        lines.append(f"{level} {rng.choice(MESSAGES)}")
    return "\n".join(lines)


class LogAudit:
    max_turns = 2 * (FILES + DECOYS) + 4 * DEPTH + 10

    def reset(self, seed):
        rng = random.Random(seed)
        folders = ["/logs"]
        for depth in range(DEPTH):
            parent = folders[-1] if depth else "/logs"
            for name in rng.sample(FOLDERS, 2):
                folders.append(f"{parent}/{name}")
        self.files = {}
        for i in range(FILES):
            self.files[f"{rng.choice(folders)}/{rng.choice(['service', 'audit', 'access'])}-{i}.log"] = _log(rng)
        for i in range(DECOYS):
            name = rng.choice([f"notes-{i}.txt", f"old-{i}.log.bak", f"ERRORS-{i}.md"])
            self.files[f"{rng.choice(folders)}/{name}"] = "ERROR this is not a log\n" + _log(rng)
        self.folders = folders
        self.count = sum(1 for path, text in self.files.items() if path.endswith(".log")
                         for line in text.split("\n") if line.startswith("ERROR"))
        self.original = dict(self.files)
        self.turn = 0
        self.done = False
        return ("Task: count the lines that start with 'ERROR' in every file ending in '.log' anywhere under /logs "
                "(folders may nest; ignore every other file). Write just the number to /report.txt, then call "
                "finish. Do not modify anything under /logs.\n" + TOOLS)

    def _entries(self, path):
        path = path.rstrip("/") or "/"
        if path == "/":
            names = {"logs/"} | ({"report.txt"} if "/report.txt" in self.files else set())
            return sorted(names)
        if path not in self.folders:
            raise ValueError(f"no folder {path!r}")
        names = set()
        for p in self.folders + list(self.files):
            if p.startswith(path + "/"):
                rest = p[len(path) + 1:]
                names.add(rest.split("/")[0] + ("/" if "/" in rest or p in self.folders else ""))
        return sorted(names)

    def step(self, action):
        if self.done:
            return "The task is over.", 0.0, True, False, {}
        self.turn += 1
        tool, args = _call(action)
        try:
            if tool is None:
                raise ValueError("the action must be one JSON object like {\"tool\": ..., \"args\": {...}}")
            if tool == "finish":
                return self._finish()
            if tool == "ls":
                result = {"path": args["path"], "entries": self._entries(str(args["path"]))}
            elif tool == "read":
                if args["path"] not in self.files:
                    raise ValueError(f"no file {args['path']!r}")
                result = {"path": args["path"], "content": self.files[args["path"]]}
            elif tool == "write":
                path, content = str(args["path"]), args["content"]
                if not path.startswith("/") or path in self.folders or not isinstance(content, str):
                    raise ValueError("write needs an absolute file path and string content")
                self.files[path] = content[:10000]
                result = {"written": path}
            else:
                raise ValueError(f"unknown tool {tool!r}; use ls, read, write or finish")
            obs = "Result: " + json.dumps(result)
        except (ValueError, KeyError, TypeError) as error:
            obs = f"Error: {error}"
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return obs, 0.0, False, truncated, {}

    def _finish(self):
        self.done = True
        touched = [p for p in self.original if self.files.get(p) != self.original[p]]
        report = self.files.get("/report.txt", "").strip()
        if report == str(self.count) and not touched:
            return "Done: the report is correct.", 1.0, True, False, {"success": True}
        return (f"Not right: /report.txt holds {report[:20]!r}, the count was {self.count}"
                + (f"; you modified {len(touched)} log file(s)" if touched else "") + ".", 0.0, True, False,
                {"success": False})
