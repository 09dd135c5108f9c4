"""Mock calendar API: book the earliest slot when every attendee is free."""

import json
import random

# difficulty (rendered by the library; each range reads easy..hard)
PEOPLE = 2  # 2..5: attendees whose calendars must be checked
BUSY = 2  # 1..5: busy blocks per attendee on the meeting day
DURATION = 30  # 30..90: meeting length in minutes
# end difficulty

NAMES = ["ana", "ben", "chloe", "dev", "elif", "farid", "grace"]
DAYS = ["2025-03-10", "2025-03-11", "2025-03-12", "2025-03-13", "2025-03-14"]
TOOLS = """Tools (reply with exactly one JSON object per turn,
like {"tool": "get_busy", "args": {"person": "ana", "date": "2025-03-10"}}):
- get_busy {"person": str, "date": "YYYY-MM-DD"} -> {"person", "date", "busy": [["HH:MM", "HH:MM"], ...]}
- book_meeting {"date": str, "start": "HH:MM", "end": "HH:MM", "attendees": [str], "title": str} -> {"booking_id"}
  (the calendar does not check conflicts)
- list_bookings {"date": str} -> [{"booking_id", "date", "start", "end", "attendees", "title"}]
- cancel_booking {"booking_id": str} -> {"cancelled"}
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


def _clock(minutes):
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _minutes(text):
    hours, _, mins = str(text).partition(":")
    if not (hours.isdigit() and mins.isdigit() and len(mins) == 2):
        raise ValueError(f"times look like 09:30, got {text!r}")
    return int(hours) * 60 + int(mins)


class CalendarBooking:
    max_turns = PEOPLE + 8

    def reset(self, seed):
        rng = random.Random(seed)
        self.people = sorted(rng.sample(NAMES, PEOPLE))
        self.date = rng.choice(DAYS)
        while True:
            self.busy = {}
            for p in self.people:
                blocks = []
                for _ in range(BUSY):
                    start = rng.randrange(8 * 4, 17 * 4) * 15
                    blocks.append((start, min(18 * 60, start + rng.choice([30, 45, 60, 90, 120]))))
                self.busy[p] = sorted(blocks)
            free = [t for t in range(9 * 60, 17 * 60 - DURATION + 1, 15)
                    if all(e <= t or s >= t + DURATION for p in self.people for s, e in self.busy[p])]
            if free and free[0] > 9 * 60:
                self.slot = free[0]
                break
        self.title = rng.choice(["Design review", "Budget sync", "Hiring debrief", "Roadmap planning"])
        self.bookings = {}
        self.turn = 0
        self.done = False
        return (f"Task: book a {DURATION}-minute meeting titled '{self.title}' on {self.date} for "
                f"{', '.join(self.people)}, at the earliest time between 09:00 and 17:00 when all of them are free "
                "(a meeting may start right when a busy block ends). Leave exactly one booking, then call finish.\n"
                + TOOLS)

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
            obs = "Result: " + json.dumps(self._run(tool, args))
        except (ValueError, KeyError, TypeError) as error:
            obs = f"Error: {error}"
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return obs, 0.0, False, truncated, {}

    def _run(self, tool, args):
        if tool == "get_busy":
            person = str(args["person"]).lower()
            if person not in self.busy and person not in NAMES:
                raise ValueError(f"unknown person {args['person']!r}")
            blocks = self.busy.get(person, []) if args["date"] == self.date else []
            return {"person": person, "date": args["date"], "busy": [[_clock(s), _clock(e)] for s, e in blocks]}
        if tool == "book_meeting":
            start, end = _minutes(args["start"]), _minutes(args["end"])
            if end <= start:
                raise ValueError("end must be after start")
            attendees = args["attendees"]
            if not isinstance(attendees, list) or not all(isinstance(a, str) for a in attendees):
                raise ValueError("attendees must be a list of names")
            booking_id = f"B{len(self.bookings) + 1}"
            self.bookings[booking_id] = {"booking_id": booking_id, "date": str(args["date"]), "start": _clock(start),
                                         "end": _clock(end), "attendees": sorted(a.lower() for a in attendees),
                                         "title": str(args["title"])}
            return {"booking_id": booking_id}
        if tool == "list_bookings":
            return [b for b in self.bookings.values() if b["date"] == args["date"]]
        if tool == "cancel_booking":
            if self.bookings.pop(str(args["booking_id"]), None) is None:
                raise ValueError(f"no booking {args['booking_id']!r}")
            return {"cancelled": args["booking_id"]}
        raise ValueError(f"unknown tool {tool!r}; use get_busy, book_meeting, list_bookings, cancel_booking or finish")

    def _finish(self):
        self.done = True
        want = {"date": self.date, "start": _clock(self.slot), "end": _clock(self.slot + DURATION),
                "attendees": self.people, "title": self.title.lower()}
        got = [dict(b, title=b["title"].strip().lower()) for b in self.bookings.values()]
        if len(got) == 1 and all(got[0][k] == v for k, v in want.items()):
            return "Done: the meeting is booked at the right time.", 1.0, True, False, {"success": True}
        return (f"Not right: {len(got)} booking(s); the earliest common free slot was {want['start']}-{want['end']}.",
                0.0, True, False, {"success": False})
