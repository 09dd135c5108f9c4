"""Scoring a model's answer against the reference, and the pass@k estimator.

One mechanism, three parametrisations (``eval.suites[].scorer``): each scorer *extracts* the final answer from the
completion and *compares* it with the reference answer.

- ``boxed`` (maths, AIME-style): the content of the ``\\boxed{...}`` (braces nested to any depth), else the last
  ``Answer: ...`` line; a reply boxing two different answers states their list, right only against a reference listing
  exactly those, a hedge otherwise (the same answer boxed twice, in any form, is one). Compared, in this order: as exact
  rational numbers when both read as one (``1,000`` = ``1000``, ``016`` = ``16``, ``2.50`` = ``5/2`` = ``\\frac{5}{2}``;
  a comma followed by a space separates list entries, so ``1, 234`` is no number; around a number, ``x =``, ``\\$``,
  ``\\%``, ``^\\circ`` and a trailing unit in ``\\text{}`` / ``\\textnormal{}`` / ``\\mbox{}`` / ``\\mathrm{}`` or in
  plain words (``5 cm``) are formatting, MATH's answers drop them, except that two different units or variables never
  match: ``5\\text{ cm}`` is not ``5\\text{ m}``, ``x = 3`` not ``y = 3``; a unit is words that name one
  (``symbolic.trailing_unit``: not ``2\\mathrm{x}``, a variable), a scale word is a factor, ``5\\text{ thousand}``
  5000); as text
  after normalisation (spaces, ``$``, ``\\text{}``, ``\\left``/``\\right``, ``\\dfrac``, a trailing full stop,
  ``\\leq`` = ``<=``, ``\\varnothing`` = ``\\{\\}``, Unicode ``π``); else symbolically (``symbolic.py``: ``2^{10}`` =
  ``1024``, ``\\sqrt{8}`` = ``2\\sqrt{2}``, ``\\pm 2`` = ``2, -2``, ``5!`` = ``120``, ``x - 3 = 0`` = ``x = 3``, tuples
  element by element, never ``1.414`` = ``\\sqrt{2}``). A reference holding a ``\\boxed{}`` (a worked solution) is its
  boxed answer. An option letter with its value (``\\textbf{(E)}\\ 12``, AMC problems in MATH) is that option: it
  equals the letter or the value, never another letter.
- ``choice`` (multiple choice, GPQA-style): the last answer letter A-J: in ``\\boxed{}`` (alone or as the label
  before its option's text, ``\\boxed{(C) 5.2 eV}``), after ``Answer:`` / ``answer
  is`` (else after ``option is`` / ``choice:``: a bare mention, ``option B is wrong``, names no answer, nor does a
  hedge, ``A or B``, nor do two different boxed letters, nor a reply whose last box was cut off), or a reply that is
  just the letter (``(C)``); compared with the reference letter.
- ``exact``: the boxed or ``Answer:`` answer (none for a hedge; else the whole reply), normalised, compared as text.

A completion without an extractable answer scores 0, like a wrong one. The fourth scorer, ``code``, runs programs
and so lives apart (``code.py``: in sandbox workers).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

from spade_mega.evaluation.symbolic import latex_symbols, trailing_unit, unwrap

# the answer: its line from its first to its last non-blank (a blank, when only blanks follow the colon). The blank
# runs are matched once: as (.+?)\s*$ after \s*(?:is)?\s*, a long run of blanks took quadratic time (150k: ~2 min)
_ANSWER_LINE = re.compile(r"(?:final\s+answer|answer)\s*+(?:is)?\s*+[:：]\s*(\S(?:[^\n]*\S)?|[^\S\n])",
                          re.IGNORECASE | re.MULTILINE)
_CHOICE = re.compile(r"^\(?([A-J])\)?[.:]?$")
_LABEL = re.compile(r"\(?([A-J])[).:](?=.)")  # "(C)12", "C.5.2EV" (normalised, upper case): an option's label


def _choice_phrase(keywords: str) -> re.Pattern[str]:
    """``<keyword> is|: [option] [**(]X[)**]``. The separator is required ("the answer I found" names no option I);
    the letter is upper case even where the words are not: "the answer is a number" names no option; a hedge
    ("A or B", "(A) and (C)") names none."""
    # possessive (*+): a letter is never a blank, so no run gives one back; backtracking, the adjacent runs after "is",
    # after ":" and before the letter split a long blank run every way (cubic: 3000 blanks ~1 min)
    letter = r"[*(\s]*+((?-i:[A-J]))[)*]*(?![A-Za-z])"
    hedge = r"(?![)*]*\s*(?:or|and|/|,)\s*[*(]*(?-i:[A-J])(?![A-Za-z]))"
    return re.compile(rf"(?:{keywords})\s*+(?:is\s*+:?|:|：)\s*+(?:option\s*+)?{letter}{hedge}", re.IGNORECASE)


# an answer phrase wins over a later remark about an option ("Answer: A. Option B is wrong because ...")
_CHOICE_PHRASES = (_choice_phrase("answer"), _choice_phrase("option|choice"))
MAX_ANSWERS = 8  # different boxed answers compared with each other; beyond, they are different by their text
# a box of a box ... is read to this depth; deeper (a degenerate loop) the rest is text: unbounded, 1000 nested boxes
# ran out of Python's recursion limit, and the RecursionError ended the evaluation
MAX_NESTED_BOXES = 16
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_LIST_COMMA = re.compile(r",\s")  # "1, 234": two entries; MATH writes thousands as 10,\!000
_VARIABLE = re.compile(r"^[A-Za-z]=")  # "x=5"
_SUFFIXES = ("\\%", "%", "^\\circ", "^{\\circ}", "°")
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")
# "(E) 12", "\\textbf{(E)}\\ 12", "\\text{(C) } \\frac12": an option's letter, then its value (to the end, its trailing
# spaces and $ stripped apart: a lazy value before \s*\$?\s* took cubic time on a run of spaces in the box)
_OPTION = re.compile(r"\$?\s*(?:\\(?:textbf|text|mathrm|textrm|mathbf)\s*\{\s*)?\(\s*([A-E])\s*\)\s*\}?"
                     r"(?:\s|\\[ ,;:]|\\q?quad|~)*(.*)", re.DOTALL)
_OTHER_OPTION = re.compile(r"\(\s*[A-E]\s*\)")  # "(A) or (B)": a second option named, a hedge
_OTHER_LABEL = re.compile(r"\(([A-J])\)|\b([A-J])\)")  # the labels in a box, spaces kept: "(A), (C)", "A) and C)"
_FRACTION = re.compile(r"([-+]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def boxed_answers(text: str) -> list[Optional[str]]:
    """The contents of every ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, in order, nested braces balanced (a box
    inside a box is part of its content; a box holding only a box is that one, to MAX_NESTED_BOXES deep); a box never
    closed ends the list as None (its answer was cut off)."""
    return _boxed_answers(text, MAX_NESTED_BOXES)


def _boxed_answers(text: str, levels: int) -> list[Optional[str]]:
    found: list[Optional[str]] = []
    at = 0
    while (match := _BOX.search(text, at)) is not None:
        rest = text[match.end():].lstrip()
        if not rest.startswith("{"):  # "\boxed 5": the token right after it; never a brace further on
            token = rest.split()[0].rstrip(".$") if rest else ""
            if token:
                found.append(token)
            at = match.end()
            continue
        open_at, depth = len(text) - len(rest), 0
        for i in range(open_at, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = text[open_at + 1:i]
                    inner = _boxed_answers(content, levels - 1) if levels and _BOX.match(content.strip()) else []
                    found.append(inner[0] if len(inner) == 1 and content.strip().endswith("}") else content)
                    at = i + 1
                    break
        else:
            found.append(None)
            break
    return found


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``); None if there is none or it is not closed."""
    boxes = boxed_answers(text)
    return boxes[-1] if boxes else None


def stated_answers(text: str, same: Optional[Callable[[str, str], bool]] = None) -> Optional[list[str]]:
    """The different answers a reply boxes (``same`` decides, past text equality after normalisation, unless over
    MAX_ANSWERS texts differ; each in the form of its last box), else its last ``Answer: ...`` line; None when it
    states none or its last box was cut off. An empty box is none: a reply restating its instructions ("within
    \\boxed{}") boxes nothing."""
    boxes = [box for box in boxed_answers(text) if box is None or normalise(box)]
    if not boxes:
        lines = _ANSWER_LINE.findall(text)
        return [lines[-1]] if lines else None
    if boxes[-1] is None:
        return None
    texts: dict[str, str] = {}  # the different texts first (each in its last form): linear in the boxes
    for box in reversed(boxes):  # type: ignore[assignment]  # only the last can be None, and it is not
        texts.setdefault(normalise(box), box)
    if same is None or len(texts) > MAX_ANSWERS:  # a reply looping through thousands of boxes: a hedge as it is
        return list(texts.values())[::-1]
    answers: list[str] = []
    for box in texts.values():  # pairwise, so few
        if not any(same(box, answer) for answer in answers):
            answers.append(box)
    return answers[::-1]


def final_answer(text: str, same: Optional[Callable[[str, str], bool]] = None) -> Optional[str]:
    """The boxed answer, else the last ``Answer: ...`` line's text; None when the reply states neither, and when it
    boxes two different answers (a hedge; see ``stated_answers``)."""
    answers = stated_answers(text, same)
    return answers[0] if answers is not None and len(answers) == 1 else None


def _maths_answer(reply: str) -> Optional[str]:
    """The boxed scorer's answer: the one answer the reply states, or the list of the different ones it boxes
    (``a, b``), which equals only a reference that lists exactly those (MATH's "all solutions": an answer boxed per
    solution); against a single answer it is a hedge and scores 0."""
    answers = stated_answers(reply, _same_boxes)
    return None if answers is None else ", ".join(answers)


def _same_boxes(one: str, other: str) -> bool:
    """Whether two boxes of one reply state one answer: ``_same_maths`` either way round (it reads the model's
    equation ``a^2 + b^2 = 25`` as 25, but not a reference's, so ``\\boxed{25}`` then that equation is one answer)."""
    return _same_maths(one, other) or _same_maths(other, one)


def normalise(answer: str) -> str:
    """Text of an answer with formatting that does not change its value removed."""
    text = unwrap(latex_symbols(answer.strip()))
    text = text.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\cfrac", "\\frac")
    text = text.replace("{,}", ",")
    text = re.sub(r"\\([lg]e|ne)q(?:slant)?(?![A-Za-z])", r"\\\1", text)  # \leq, \leqslant: \le
    text = re.sub(r"\\([lg])t(?![A-Za-z])", lambda m: "<" if m.group(1) == "l" else ">", text)  # \lt: <
    text = text.replace("<=", "\\le ").replace(">=", "\\ge ").replace("!=", "\\ne ")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)  # \frac12
    text = re.sub(r"_\{(\w)\}", r"_\1", text)  # 1011_{2} is 1011_2 (a number in base 2)
    for spacing in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "$"):
        text = text.replace(spacing, "")
    text = re.sub(r"\s+", "", text).replace("\\varnothing", "\\emptyset").replace("\\{\\}", "\\emptyset")
    return text.rstrip(".").strip()


def as_number(answer: str) -> Optional[Fraction]:
    """``answer`` (normalised) as an exact number: an integer, a decimal, ``a/b`` or ``\\frac{a}{b}``, thousands
    commas allowed; None when it is anything else (an expression, an interval, text)."""
    text = answer
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    fraction = _FRACTION.fullmatch(text)
    if fraction is not None:
        sign, num, den = fraction.groups()
        text = f"{sign}{num}/{den}"
    parts = text.split("/")
    if len(parts) > 2 or not all(_NUMBER.fullmatch(p) for p in parts):
        return None
    try:
        value = Fraction(parts[0])
        if len(parts) == 2:
            den = Fraction(parts[1])
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _number_and_unit(answer: str) -> Optional[tuple[Fraction, str, str]]:
    """An answer that is one number with at most the formatting the module docstring lists: (number, unit or "",
    the letter of a leading ``x=`` or "")."""
    if _LIST_COMMA.search(answer):
        return None
    unit = trailing_unit(answer)  # 5\text{ cm}; not 2\mathrm{x}, which stays in the text (no number)
    text = answer[:unit.start] if unit is not None else answer
    text = normalise(text.replace("\\$", ""))
    variable = text[0] if _VARIABLE.match(text) else ""
    text = _VARIABLE.sub("", text)
    for suffix in _SUFFIXES:
        text = text.removesuffix(suffix)
    value = as_number(text)
    if value is None:
        return None
    return (value, "", variable) if unit is None else (value * unit.factor, unit.name, variable)  # 5 thousand: 5000


def _option(answer: str) -> Optional[tuple[str, str]]:
    """A multiple-choice answer as AMC problems in MATH write it: (its letter, the option's value as written, or "")
    for ``(E) 12``, ``\\textbf{(E)}\\ 12``, ``\\text{(E)}``, ``E``; None for anything else, and for an answer naming
    two options (``(A) \\text{ or } (B)``, ``(A), (C)``: a hedge, not option A with a value)."""
    found = _OPTION.fullmatch(answer.strip())
    if found is not None:
        value = found.group(2).rstrip()
        value = value[:-1].strip() if value.endswith("$") else value.strip()
        return None if _OTHER_OPTION.search(value) else (found.group(1), value)
    letter = _CHOICE.fullmatch(normalise(answer))
    return (letter.group(1), "") if letter is not None and letter.group(1) in "ABCDE" else None


def _same_maths(predicted: str, reference: str) -> bool:
    reference = last_boxed(reference) or reference  # a worked solution (MATH's solution field): its boxed answer
    x, y = _option(predicted), _option(reference)
    if x is not None and y is not None:  # (E) 12 is (E) and E, not (D) 12: the letter is the option chosen
        return x[0] == y[0] and (not x[1] or not y[1] or _same_maths(x[1], y[1]))
    if x is not None or y is not None:  # (E) 12 against 12: its value
        value, other = (x[1], reference) if x is not None else (y[1], predicted)  # type: ignore[index]
        return bool(value) and _same_maths(value, other)
    x, y = _number_and_unit(predicted), _number_and_unit(reference)
    if x is not None and y is not None:
        if (x[1] and y[1] and x[1] != y[1]) or (x[2] and y[2] and x[2] != y[2]):
            return False  # 5 cm is not 5 m, the line x = 3 not y = 3
        if x[0] == y[0]:
            return True
    text = normalise(predicted)
    if text == normalise(reference) and not (_THOUSANDS.fullmatch(text) and bool(_LIST_COMMA.search(predicted)) !=
                                             bool(_LIST_COMMA.search(reference))):
        return True  # the same text; but normalised, the list "12, 345" reads as the number 12,345
    from spade_mega.evaluation.symbolic import equivalent  # sympy is imported on first use

    return equivalent(predicted, reference)


def _boxed_letter(box: str) -> Optional[str]:
    """The letter a box names: the letter alone (``C``, ``(C)``), or an option's label before its text (``(C) 5.2
    eV``, ``\\textbf{(C)} 12``, ``C. 5.2 eV``, ``C) 12``; not ``A cat``, an article, nor ``(A) or (B)``, a hedge)."""
    text = normalise(box).upper()
    match = _CHOICE.fullmatch(text) or _LABEL.match(text)
    if match is None or any(set(other) - {"", match.group(1)} for other in _OTHER_LABEL.findall(unwrap(box).upper())):
        return None
    return match.group(1)


def choice_letter(text: str) -> Optional[str]:
    """The answer letter a reply ends on (see the module docstring); None if it names none."""
    found = boxed_answers(text)
    if found and found[-1] is None:
        return None  # its last box was cut off: the letter it ends on is unknown (the boxed scorer reads none either)
    boxes = [box for box in found if box is not None]  # only the last could be None
    letters = {letter for letter in map(_boxed_letter, boxes) if letter}
    if len(letters) > 1:
        return None  # \boxed{A} ... \boxed{C} is a hedge, as "A or B" is
    if boxes and _boxed_letter(boxes[-1]):
        return _boxed_letter(boxes[-1])
    for phrase in _CHOICE_PHRASES:
        letters = phrase.findall(text)
        if letters:
            return letters[-1]
    match = _CHOICE.fullmatch(normalise(text).upper())
    return match.group(1) if match else None


@dataclass(frozen=True)
class Scorer:
    """``extract(reply)`` -> the answer or None; ``equal(answer, reference)``."""

    name: str
    extract: Callable[[str], Optional[str]]
    equal: Callable[[str, str], bool]

    def __call__(self, reply: str, reference: str) -> tuple[Optional[str], bool]:
        """The extracted answer and whether it is right."""
        answer = self.extract(reply)
        return answer, answer is not None and self.equal(answer, reference)


def _exact_answer(reply: str) -> Optional[str]:
    """The boxed or ``Answer:`` answer (None for a hedge), else the whole reply."""
    stated = bool(boxed_answers(reply)) or _ANSWER_LINE.search(reply) is not None
    return final_answer(reply) if stated else reply


def reference_letter(reference: str) -> str:
    """The option letter a ``choice`` reference names (``C``, ``(C)``, ``Answer: C``); else its normalised text, which
    no reply's letter equals."""
    return choice_letter(reference) or normalise(reference).upper()


SCORERS: dict[str, Scorer] = {
    "boxed": Scorer("boxed", _maths_answer, _same_maths),
    "choice": Scorer("choice", choice_letter, lambda answer, reference: answer == reference_letter(reference)),
    "exact": Scorer("exact", _exact_answer,
                    lambda answer, reference: normalise(answer) == normalise(reference)),
}


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``correct`` are right (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement hold a right one."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_ks(samples: int) -> list[int]:
    """The k reported for ``samples`` per item: powers of two above 1, and ``samples`` itself (pass@1 is the
    accuracy, reported as such)."""
    return sorted({k for k in (2 ** i for i in range(1, samples.bit_length())) if k <= samples} | {samples} - {1})
