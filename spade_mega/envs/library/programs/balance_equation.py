"""Balance a chemical equation with the smallest whole-number coefficients."""

import math
import random
import re

# difficulty (rendered by the library; each range reads easy..hard)
TIER = 2  # 1..3: 1 simple (3 species), 2 combustions and displacements, 3 bracketed groups and redox
ATTEMPTS = 3  # 3..1: answers allowed
# end difficulty

REACTIONS = {
    1: ["H2 + O2 -> H2O", "N2 + H2 -> NH3", "Na + Cl2 -> NaCl", "Fe + O2 -> Fe2O3", "Al + O2 -> Al2O3",
        "P4 + O2 -> P2O5", "SO2 + O2 -> SO3", "H2O2 -> H2O + O2", "KClO3 -> KCl + O2", "Fe + Cl2 -> FeCl3",
        "Mg + N2 -> Mg3N2", "Li + O2 -> Li2O"],
    2: ["CH4 + O2 -> CO2 + H2O", "C3H8 + O2 -> CO2 + H2O", "C2H6 + O2 -> CO2 + H2O", "C4H10 + O2 -> CO2 + H2O",
        "Al + HCl -> AlCl3 + H2", "Zn + HCl -> ZnCl2 + H2", "Fe2O3 + CO -> Fe + CO2", "NH3 + O2 -> NO + H2O",
        "C2H5OH + O2 -> CO2 + H2O", "NO2 + H2O -> HNO3 + NO", "C6H12O6 + O2 -> CO2 + H2O",
        "Fe2O3 + C -> Fe + CO2"],
    3: ["Ca(OH)2 + HCl -> CaCl2 + H2O", "Al2(SO4)3 + Ca(OH)2 -> Al(OH)3 + CaSO4",
        "Cu + HNO3 -> Cu(NO3)2 + NO + H2O", "KMnO4 + HCl -> KCl + MnCl2 + Cl2 + H2O",
        "Pb(NO3)2 -> PbO + NO2 + O2", "Ca3(PO4)2 + SiO2 + C -> CaSiO3 + P4 + CO",
        "Fe(OH)3 + H2SO4 -> Fe2(SO4)3 + H2O", "Ba(OH)2 + H3PO4 -> Ba3(PO4)2 + H2O",
        "K2Cr2O7 + HCl -> KCl + CrCl3 + Cl2 + H2O"],
}


def _atoms(formula):
    """Element counts of a formula such as Ca3(PO4)2."""
    stack = [{}]
    for element, count, opening, closing, multiplier in re.findall(r"([A-Z][a-z]?)(\d*)|(\()|(\))(\d*)", formula):
        if opening:
            stack.append({})
        elif closing:
            group = stack.pop()
            for el, n in group.items():
                stack[-1][el] = stack[-1].get(el, 0) + n * int(multiplier or 1)
        else:
            stack[-1][element] = stack[-1].get(element, 0) + int(count or 1)
    return stack[0]


class BalanceEquation:
    max_turns = ATTEMPTS

    def reset(self, seed):
        rng = random.Random(seed)
        left, right = [side.split(" + ") for side in rng.choice(REACTIONS[TIER]).split(" -> ")]
        rng.shuffle(left)
        rng.shuffle(right)
        self.species = [(f, 1) for f in left] + [(f, -1) for f in right]
        self.equation = f"{' + '.join(left)} -> {' + '.join(right)}"
        self.attempt = 0
        self.done = False
        return (f"Balance this chemical equation: {self.equation}\nReply with the {len(self.species)} smallest "
                f"positive whole-number coefficients in the order the formulas appear, separated by commas "
                f"(e.g. {', '.join('1' for _ in self.species)}). You have {ATTEMPTS} attempt(s).")

    def step(self, action):
        if self.done:
            return "The game is over.", 0.0, True, False, {}
        self.attempt += 1
        coefs = [int(v) for v in re.findall(r"-?\d+", action)]
        if len(coefs) != len(self.species) or min(coefs) < 1:
            problem = f"give exactly {len(self.species)} positive whole numbers"
        else:
            net = {}
            for (formula, sign), coef in zip(self.species, coefs):
                for el, n in _atoms(formula).items():
                    net[el] = net.get(el, 0) + sign * coef * n
            off = [el for el in sorted(net) if net[el]]
            if off:
                problem = "unbalanced: " + ", ".join(
                    f"{el} (left {net[el] + self._right(el, coefs)}, right {self._right(el, coefs)})" for el in off)
            elif math.gcd(*coefs) != 1:
                problem = "balanced, but not the smallest whole numbers"
            else:
                self.done = True
                return "Balanced!", 1.0 / 2 ** (self.attempt - 1), True, False, {"attempts": self.attempt}
        if self.attempt == ATTEMPTS:
            self.done = True
            return f"Wrong ({problem}). No attempts left.", 0.0, True, False, {"attempts": self.attempt}
        return f"Wrong ({problem}). Attempts left: {ATTEMPTS - self.attempt}.", 0.0, False, False, {}

    def _right(self, element, coefs):
        return sum(c * _atoms(f).get(element, 0) for (f, sign), c in zip(self.species, coefs) if sign < 0)
