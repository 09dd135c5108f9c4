"""Stateful tool-use environments (JSON calls against in-memory mock APIs) and their oracles."""

from __future__ import annotations

import json
import re
from typing import Any, Generator

from spade_mega.envs.library.entry import LibraryEntry

Script = Generator[str, str, Any]


def _call(tool: str, **args: Any) -> str:
    return json.dumps({"tool": tool, "args": args})


def _result(obs: str) -> Any:
    """The JSON payload of a tool result; an error here means the oracle itself called a tool wrongly."""
    if not obs.startswith("Result: "):
        raise RuntimeError(f"oracle tool call failed: {obs[:300]}")
    return json.loads(obs[len("Result: "):])


def _ask(tool: str, **args: Any) -> Generator[str, str, Any]:
    """``result = yield from _ask(...)``: one tool call and its parsed result."""
    return _result((yield _call(tool, **args)))


def bank_transfer_oracle(obs: str) -> Script:
    payer, city, payee, owed = re.search(r"Task: (.+?) from (\w+) owes (.+?) \$(\d+)\.", obs).groups()
    amount = int(owed)
    customer = next(c for c in (yield from _ask("find_customer", name=payer)) if c["city"] == city)
    balances = []
    for account in (yield from _ask("list_accounts", customer_id=customer["customer_id"])):
        balances.append((yield from _ask("get_balance", account_id=account["account_id"])))
    payee_id = (yield from _ask("find_customer", name=payee))[0]["customer_id"]
    dest = next(a["account_id"] for a in (yield from _ask("list_accounts", customer_id=payee_id))
                if a["type"] == "checking")
    left = amount
    for account in sorted(balances, key=lambda b: -b["balance"]):
        part = min(left, account["balance"])
        if part > 0:
            yield from _ask("transfer", from_account=account["account_id"], to_account=dest, amount=part)
            left -= part
    yield _call("finish")


def _minutes(clock: str) -> int:
    hours, mins = clock.split(":")
    return int(hours) * 60 + int(mins)


def calendar_booking_oracle(obs: str) -> Script:
    duration, title, date, people = re.search(
        r"book a (\d+)-minute meeting titled '(.+?)' on ([\d-]+) for (.+?), at the earliest", obs).groups()
    names, duration = people.split(", "), int(duration)
    busy: list[tuple[int, int]] = []
    for person in names:
        busy += [(_minutes(s), _minutes(e)) for s, e in (yield from _ask("get_busy", person=person, date=date))["busy"]]
    starts = sorted({9 * 60} | {e for _, e in busy})  # the earliest start is 09:00 or the end of a busy block
    start = next(t for t in starts if 9 * 60 <= t and t + duration <= 17 * 60
                 and all(e <= t or s >= t + duration for s, e in busy))
    yield from _ask("book_meeting", date=date, start=f"{start // 60:02d}:{start % 60:02d}",
                    end=f"{(start + duration) // 60:02d}:{(start + duration) % 60:02d}", attendees=names, title=title)
    yield _call("finish")


def web_shop_oracle(obs: str) -> Script:
    quantity, color, kind = re.search(r"buy (\d+) units of the cheapest (\w+) (\w+)", obs).groups()
    quantity = int(quantity)
    stock = re.search(r"at least (\d+) in stock", obs)
    rating = re.search(r"rated ([\d.]+) or higher", obs)
    items = []
    for hit in (yield from _ask("search", query=f"{color} {kind}")):
        items.append((yield from _ask("get_item", item_id=hit["item_id"])))
    fits = [item for item in items if (stock is None or item["stock"] >= int(stock[1]))
            and (rating is None or item["rating"] >= float(rating[1]))]
    best = min(fits, key=lambda item: item["price"])
    yield from _ask("add_to_cart", item_id=best["item_id"], quantity=quantity)
    yield _call("checkout")


def log_audit_oracle(obs: str) -> Script:
    folders, logs = ["/logs"], []
    while folders:
        folder = folders.pop()
        for entry in (yield from _ask("ls", path=folder))["entries"]:
            path = f"{folder}/{entry.rstrip('/')}"
            if entry.endswith("/"):
                folders.append(path)
            elif entry.endswith(".log"):
                logs.append(path)
    count = 0
    for path in logs:
        content = (yield from _ask("read", path=path))["content"]
        count += sum(line.startswith("ERROR") for line in content.split("\n"))
    yield from _ask("write", path="/report.txt", content=str(count))
    yield _call("finish")


ENTRIES = [
    LibraryEntry(
        name="bank_transfer",
        skill="tool_use",
        summary="disambiguating a customer, reading balances and splitting a payment across accounts",
        hint="First find the payer and pick the customer in the stated city (namesakes exist). List their "
             "accounts and read every balance before moving money: no single account covers the debt, so "
             "transfer from the largest balances first until the exact amount is sent. Look up the payee's "
             "checking account id (not savings).",
        oracle=bank_transfer_oracle,
        target_return=1.0,
        action_examples=('{"tool": "find_customer", "args": {"name": "{word}"}}',
                         '{"tool": "get_balance", "args": {"account_id": "ACC-{int}"}}',
                         '{"tool": "transfer", "args": {"from_account": "ACC-{int}", "to_account": "ACC-{int}", '
                         '"amount": {int}}}',
                         '{"tool": "finish", "args": {}}'),
    ),
    LibraryEntry(
        name="calendar_booking",
        skill="tool_use",
        summary="gathering every attendee's busy blocks and computing the earliest common free slot",
        hint="Query get_busy for every attendee on the meeting date before booking. Candidate start times are "
             "09:00 and the end of each busy block; take the earliest candidate where the whole meeting fits "
             "before 17:00 without overlapping anyone's block, book it once with the exact title, then finish.",
        oracle=calendar_booking_oracle,
        target_return=1.0,
        action_examples=('{"tool": "get_busy", "args": {"person": "{word}", "date": "2025-03-1{int}"}}',
                         '{"tool": "book_meeting", "args": {"date": "2025-03-12", "start": "10:00", "end": "11:00", '
                         '"attendees": ["{word}"], "title": "{word}"}}',
                         '{"tool": "finish", "args": {}}'),
    ),
    LibraryEntry(
        name="web_shop",
        skill="tool_use",
        summary="search, inspect every candidate and apply price, stock and rating constraints before checkout",
        hint="Search with the colour and the product kind, then call get_item on every result: search results "
             "show no prices. Drop items with too little stock or too low a rating, add the cheapest remaining "
             "one in the exact quantity, and check out with nothing else in the cart.",
        oracle=web_shop_oracle,
        target_return=1.0,
        action_examples=('{"tool": "search", "args": {"query": "{word} {word}"}}',
                         '{"tool": "get_item", "args": {"item_id": "P{int}"}}',
                         '{"tool": "add_to_cart", "args": {"item_id": "P{int}", "quantity": {int}}}',
                         '{"tool": "checkout", "args": {}}'),
    ),
    LibraryEntry(
        name="log_audit",
        skill="tool_use",
        summary="walking a nested mock file system, filtering by extension and aggregating file contents",
        hint="Walk the whole tree: ls /logs, then ls every entry ending in '/' (folders nest). Read only files "
             "whose name ends exactly in '.log' (not .log.bak, not .txt), count the lines that begin with ERROR "
             "(not lines that merely contain it), write the number alone to /report.txt and call finish.",
        oracle=log_audit_oracle,
        target_return=1.0,
        action_examples=('{"tool": "ls", "args": {"path": "/logs"}}',
                         '{"tool": "read", "args": {"path": "/logs/{word}"}}',
                         '{"tool": "write", "args": {"path": "/report.txt", "content": "{int}"}}',
                         '{"tool": "finish", "args": {}}'),
    ),
]
