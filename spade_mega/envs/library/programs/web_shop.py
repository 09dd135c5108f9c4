"""Mock shop API: find the cheapest product that meets every requirement and buy exactly what was asked."""

import json
import random

# difficulty (rendered by the library; each range reads easy..hard)
CANDIDATES = 3  # 3..8: products matching the search words
REQUIREMENTS = 1  # 1..3: 1 cheapest only, 2 also enough stock, 3 also a minimum rating
# end difficulty

COLORS = ["blue", "red", "green", "black", "white"]
KINDS = ["mug", "notebook", "lamp", "backpack", "scarf"]
STYLES = ["classic", "travel", "mini", "deluxe", "eco", "retro", "studio", "pro", "soft", "urban"]
TOOLS = """Tools (reply with exactly one JSON object per turn, like {"tool": "search", "args": {"query": "..."}}):
- search {"query": str} -> products whose name contains every word: [{"item_id", "name"}]
- get_item {"item_id": str} -> {"item_id", "name", "price", "stock", "rating"}
- add_to_cart {"item_id": str, "quantity": int} -> the cart
- remove_from_cart {"item_id": str} -> the cart
- view_cart {} -> {"items": {item_id: quantity}}
- checkout {} -> places the order and ends the task"""


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


class WebShop:
    max_turns = CANDIDATES + 8

    def reset(self, seed):
        rng = random.Random(seed)
        self.color, self.kind = rng.choice(COLORS), rng.choice(KINDS)
        self.quantity = rng.randint(2, 5)
        self.min_rating = rng.choice([3.5, 4.0, 4.5])
        ids = rng.sample(range(10000, 99999), 80)
        self.items = {}
        for color in COLORS:
            for kind in KINDS:
                n = CANDIDATES if (color, kind) == (self.color, self.kind) else rng.randint(0, 2)
                for style in rng.sample(STYLES, n):
                    self.items[f"P{ids.pop()}"] = {"name": f"{color.title()} {style} {kind}",
                                                    "price": round(rng.uniform(4, 60), 2),
                                                    "stock": rng.randint(0, 9), "rating": rng.choice(
                                                        [2.5, 3.0, 3.5, 4.0, 4.5, 5.0])}
        matches = sorted((a for a, v in self.items.items() if v["name"].startswith(self.color.title())
                          and v["name"].endswith(self.kind)), key=lambda a: self.items[a]["price"])
        # the cheapest match must fail each requirement in play, so skipping a check buys the wrong product
        if REQUIREMENTS >= 2:
            self.items[matches[0]]["stock"] = rng.randint(0, self.quantity - 1)
        if REQUIREMENTS >= 3:
            self.items[matches[min(1, len(matches) - 1)]]["rating"] = self.min_rating - 1.0
        good = [a for a in matches if self._ok(a)]
        if not good:
            self.items[matches[-1]].update(stock=9, rating=5.0)
            good = [matches[-1]]
        self.target = good[0]
        self.items[self.target]["stock"] = max(self.items[self.target]["stock"], self.quantity)
        self.cart = {}
        self.turn = 0
        self.done = False
        needs = [f"at least {self.quantity} in stock" if REQUIREMENTS >= 2 else "",
                 f"rated {self.min_rating} or higher" if REQUIREMENTS >= 3 else ""]
        needs = " and ".join(n for n in needs if n)
        return (f"Task: buy {self.quantity} units of the cheapest {self.color} {self.kind}"
                + (f" that is {needs}" if needs else "") + ". The cart must hold only that product, in that "
                "quantity, when you check out.\n" + TOOLS)

    def _ok(self, item_id):
        item = self.items[item_id]
        return ((REQUIREMENTS < 2 or item["stock"] >= self.quantity)
                and (REQUIREMENTS < 3 or item["rating"] >= self.min_rating))

    def step(self, action):
        if self.done:
            return "The task is over.", 0.0, True, False, {}
        self.turn += 1
        tool, args = _call(action)
        try:
            if tool is None:
                raise ValueError("the action must be one JSON object like {\"tool\": ..., \"args\": {...}}")
            if tool == "checkout":
                self.done = True
                if self.cart == {self.target: self.quantity}:
                    return "Order placed: exactly right.", 1.0, True, False, {"success": True}
                return f"Order placed, but it is not what was asked: {json.dumps(self.cart)}.", 0.0, True, False, {
                    "success": False}
            obs = "Result: " + json.dumps(self._run(tool, args))
        except (ValueError, KeyError, TypeError) as error:
            obs = f"Error: {error}"
        truncated = self.turn >= self.max_turns
        self.done = truncated
        return obs, 0.0, False, truncated, {}

    def _run(self, tool, args):
        if tool == "search":
            words = str(args["query"]).lower().split()
            return [{"item_id": a, "name": v["name"]} for a, v in sorted(self.items.items())
                    if words and all(w in v["name"].lower().split() for w in words)]
        if tool in ("get_item", "add_to_cart", "remove_from_cart") and args.get("item_id") not in self.items:
            raise ValueError(f"no item {args.get('item_id')!r}")
        if tool == "get_item":
            return dict(self.items[args["item_id"]], item_id=args["item_id"])
        if tool == "add_to_cart":
            quantity = args["quantity"]
            if type(quantity) is not int or quantity < 1:
                raise ValueError("quantity must be a positive integer")
            if self.cart.get(args["item_id"], 0) + quantity > self.items[args["item_id"]]["stock"]:
                raise ValueError("not enough stock")
            self.cart[args["item_id"]] = self.cart.get(args["item_id"], 0) + quantity
            return {"items": self.cart}
        if tool == "remove_from_cart":
            self.cart.pop(args["item_id"], None)
            return {"items": self.cart}
        if tool == "view_cart":
            return {"items": self.cart}
        raise ValueError(f"unknown tool {tool!r}; use search, get_item, add_to_cart, remove_from_cart, view_cart "
                         "or checkout")
