"""Mock banking API: pay a debt from the right customer's accounts without overdrawing any of them."""

import json
import random

# difficulty (rendered by the library; each range reads easy..hard)
ACCOUNTS = 2  # 2..5: accounts the payer holds
NAMESAKES = 1  # 0..3: other customers with the payer's name (in other cities)
# end difficulty

FIRST = ["Alice", "Maria", "Omar", "Chen", "Priya", "Lukas", "Sofia", "Kwame"]
LAST = ["Moreno", "Schmidt", "Okafor", "Tanaka", "Dubois", "Novak", "Haddad", "Larsen"]
CITIES = ["Lyon", "Porto", "Osaka", "Leeds", "Graz", "Tunis", "Quebec", "Perth"]
TOOLS = """Tools (reply with exactly one JSON object per turn, like {"tool": "find_customer", "args": {"name": "..."}}):
- find_customer {"name": str} -> customers whose name contains it: [{"customer_id", "name", "city"}]
- list_accounts {"customer_id": str} -> [{"account_id", "type"}]
- get_balance {"account_id": str} -> {"account_id", "balance"}
- transfer {"from_account": str, "to_account": str, "amount": number} -> {"transfer_id"} (fails if it would overdraw)
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


class BankTransfer:
    max_turns = 10 + 3 * ACCOUNTS

    def reset(self, seed):
        rng = random.Random(seed)
        first, last = rng.sample(FIRST, 2), rng.sample(LAST, 2)
        cities = rng.sample(CITIES, NAMESAKES + 2)
        payer = f"{first[0]} {last[0]}"
        self.customers = []
        self.accounts = {}
        numbers = rng.sample(range(1000, 10000), ACCOUNTS * (NAMESAKES + 1) + 2)
        for i in range(NAMESAKES + 1):
            cid = f"C{rng.randint(100, 999)}{i}"
            self.customers.append({"customer_id": cid, "name": payer, "city": cities[i]})
            kinds = ["checking", "savings", "travel", "joint", "business"]
            for k in range(ACCOUNTS):
                self.accounts[f"ACC-{numbers.pop()}"] = {"owner": cid, "type": kinds[k],
                                                          "balance": rng.randint(50, 900)}
        self.payer = self.customers[0]["customer_id"]
        payee_id = f"C{rng.randint(100, 999)}9"
        self.customers.append({"customer_id": payee_id, "name": f"{first[1]} {last[1]}", "city": cities[-1]})
        for kind in ("savings", "checking"):
            self.accounts[f"ACC-{numbers.pop()}"] = {"owner": payee_id, "type": kind, "balance": rng.randint(0, 500)}
        self.dest = next(a for a, v in self.accounts.items() if v["owner"] == payee_id and v["type"] == "checking")
        order = self.customers[:]
        rng.shuffle(order)
        self.customers = order
        balances = [v["balance"] for v in self.accounts.values() if v["owner"] == self.payer]
        self.amount = rng.randint(max(balances) + 1, sum(balances))
        self.start = {a: v["balance"] for a, v in self.accounts.items()}
        self.turn = 0
        self.done = False
        city = cities[0]
        return (f"Task: {payer} from {city} owes {first[1]} {last[1]} ${self.amount}. Using the bank API, move "
                f"exactly ${self.amount} from {payer}'s accounts into {first[1]} {last[1]}'s checking account. "
                "No single account may go below $0; touch no other account. Then call finish.\n" + TOOLS)

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
            result = self._run(tool, args)
            obs = "Result: " + json.dumps(result)
        except (ValueError, KeyError, TypeError) as error:
            obs = f"Error: {error}"
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return obs, 0.0, False, truncated, {}

    def _run(self, tool, args):
        if tool == "find_customer":
            name = str(args["name"]).lower()
            return [c for c in self.customers if name and name in c["name"].lower()]
        if tool == "list_accounts":
            return [{"account_id": a, "type": v["type"]} for a, v in sorted(self.accounts.items())
                    if v["owner"] == args["customer_id"]]
        if tool == "get_balance":
            if args["account_id"] not in self.accounts:
                raise ValueError(f"no account {args['account_id']!r}")
            return {"account_id": args["account_id"], "balance": self.accounts[args["account_id"]]["balance"]}
        if tool == "transfer":
            src, dst, amount = args["from_account"], args["to_account"], args["amount"]
            if src not in self.accounts or dst not in self.accounts or src == dst:
                raise ValueError("unknown or identical accounts")
            if type(amount) not in (int, float) or not amount > 0 or round(amount, 2) != amount:
                raise ValueError("amount must be a positive number of dollars with at most 2 decimals")
            if self.accounts[src]["balance"] < amount:
                raise ValueError(f"insufficient funds in {src}")
            self.accounts[src]["balance"] = round(self.accounts[src]["balance"] - amount, 2)
            self.accounts[dst]["balance"] = round(self.accounts[dst]["balance"] + amount, 2)
            return {"transfer_id": f"T{self.turn:03d}", "status": "ok"}
        raise ValueError(f"unknown tool {tool!r}; use find_customer, list_accounts, get_balance, transfer or finish")

    def _finish(self):
        self.done = True
        paid = round(sum(self.start[a] - v["balance"] for a, v in self.accounts.items() if v["owner"] == self.payer), 2)
        received = round(self.accounts[self.dest]["balance"] - self.start[self.dest], 2)
        others = [a for a, v in self.accounts.items() if a != self.dest and v["owner"] != self.payer
                  and v["balance"] != self.start[a]]
        if paid == received == self.amount and not others:
            return "Done: the debt is paid correctly.", 1.0, True, False, {"success": True}
        return (f"Not done right: the payer's accounts paid ${paid}, the checking account received ${received}, "
                f"other accounts changed: {len(others)}.", 0.0, True, False, {"success": False})
