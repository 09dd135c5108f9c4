"""Symbolic equivalence of two maths answers: our own small LaTeX -> sympy translation for the forms AIME / MATH
answers take, then a bounded comparison. Model text is never ``eval()``-ed nor handed to sympy's own parsers: a
recursive-descent parser builds the expression from a fixed set of constructs, and anything else is refused (the
caller then compares text).

Translated: integers and decimals (exact rationals), repeating decimals (``0.1\\overline{6}`` is 1/6; ``\\bar``
too), ``+ - * /``, ``\\cdot``, ``\\times``, ``\\div``, implicit multiplication (``2\\sqrt{2}``, ``3\\pi``, ``2x``,
``4(x+1)``), ``^`` (``2^{10}``; a bare ``^`` takes one character, as in LaTeX), ``\\frac`` / ``\\dfrac`` /
``\\tfrac`` / ``\\cfrac`` (``\\frac12`` too), a mixed number ``2\\frac{1}{2}`` (5/2, as math-verify reads it; only an
integer and a proper fraction of integers that nothing multiplies or raises: ``2\\frac{1}{2}x`` is refused),
``\\sqrt{x}``, ``\\sqrt[n]{x}`` and ``x^{p/q}`` (for an odd q, of a negative number, the real value: ``\\sqrt[3]{-8}``
and ``(-8)^{1/3}`` are -2; of an expression, sympy's principal root), ``n!`` and ``\\binom{n}{k}``
(``\\dbinom``, ``\\tbinom``, ``{n \\choose k}``) of natural numbers up to ``MAX_FACTORIAL`` or of expressions in
variables, ``\\pi``, ``e``, ``i`` (the imaginary unit), ``\\infty``, ``|x|``, ``\\sin`` ... ``\\ln``, ``\\log_b``
and ``\\log`` (base 10, as math-verify and Qwen2.5-Math's grader, through latex2sympy, read it; ``\\ln`` is the
natural logarithm), letters and Greek letters as variables (``x_1`` too), ``\\mathbb{R}`` (the interval),
parentheses, brackets and braces as grouping. Around it: a tuple or interval ``(a, b]`` (brackets must match,
compared element by element), a vector or matrix (``pmatrix``, ``bmatrix``: entry by entry, in the same shape), a
set ``\\{a, b\\}`` or a bare list ``a, b`` (``6 \\text{ and } 8`` too; compared as sets, in any order; its entries
may be named, ``x = 1, x = 2``), ``a \\pm b`` (the set of ``a + b`` and ``a - b``, every ``\\pm`` taking the same
sign and ``\\mp`` the other; in a list, its two values are two entries), a union ``A \\cup B``, an equation
``y = 2x + 1`` (``x =``, ``f(x) =``, ``(x, y) =`` or ``x \\in`` before a value is dropped, but ``x = 3`` is not
``y = 3``, and ``x = 2x + 1`` is an equation in x, not the value 2x + 1; two equations are the same when their
``lhs - rhs`` agree up to a non-zero constant factor: ``2x = 6`` is ``x = 3``, ``y = x`` is ``x = y``, but
``(x-3)^2 = 0`` is not ``x = 3`` and no equation is a bare value, ``x - 3 = 0`` is not ``3``, unless its right
side is a non-zero number, which it states: ``m + n = 25`` is 25, as math-verify reads it; the reference's equation
only when its left side is variables alone, also as math-verify: the reference circle ``x^2 + y^2 = 25`` is not the
answer 25; an equation in numbers that holds states its right side, ``3 \\times 4 = 12`` is 12), a trailing percent
sign (a percentage equals its number with or without the sign, and its number / 100 against a side without one),
degrees (``^\\circ``: formatting) and a trailing unit in ``\\text{}`` / ``\\mathrm{}`` / ``\\unit{}`` or in plain
words of two letters or more (``2 cm``, ``3 hours``; words of ``_UNIT_WORDS`` only, ``^2`` / ``^3`` part of the unit;
two different units never match; a letter that names no unit is a variable, ``2\\mathrm{x}`` is 2x, and a plain
letter is one, ``2g`` is 2g; a scale word is a factor, not a unit: ``5\\text{ thousand}`` is 5000, ``5\\text{
dozen}`` 60, never 5), each entry of a tuple, set or list with its own (``(2\\text{ cm}, 3\\text{ cm})`` is ``(2,
3)``).

Refused (not translated): words (``\\text{odd}``, ``even``: letters as a product of variables would make anagrams equal;
other trailing words, ``5\\text{ thousands place}``: a place value), a mixed number that something multiplies
(``2\\frac{1}{2}x``: 2 x/2 or 5x/2?) or with an improper fraction (``2\\frac{3}{2}``), two numbers side by side,
``\\pm`` in a tuple (``(\\pm 1, \\pm 2)``: two points or four?), an identity in variables (``x = x``: no relation, so
two of them are not one answer; the text decides) and a false equation in numbers (``0 = 1``), inequalities and
``!=``, a double factorial ``5!!``,
determinants (``vmatrix``), answers over ``MAX_CHARS`` characters, sets, lists and matrices of over ``MAX_ITEMS``
entries (matched item against item; each ``\\pm`` counts two), a power whose value would have over ``MAX_DIGITS`` digits
(``9^{9^{9^9}}``, and with an irrational exponent ``e^{e^{e^9}}``, which evalf would need to that many digits), a
trigonometric function of a number of over ``MAX_DIGITS`` digits, a root of a number of over ``MAX_ROOT_DIGITS`` digits,
a factorial or binomial of more than ``MAX_FACTORIAL`` (at the identity test's points, for an expression) and functions,
roots or non-integer powers nested over ``MAX_NESTING`` deep (``\\log(\\log(\\log(\\log 5)))``: evalf's time grows
tenfold and more a level): sympy evaluates powers, roots and factorials of rationals as it builds them, so the size is
checked before; that is the bound on sympy's work (no timer: the same answers always give the same verdict).

Comparison: equal when sympy's canonical form of the difference is 0, or, when it is no rational number (a rational
non-zero difference is exact: ``1.414`` is not ``\\sqrt{2}``), when both sides evaluate to the same value to
``DIGITS`` significant digits (``PRECISION`` digits computed) at three fixed points of their variables, and their
difference there is not provably non-zero (evalf finds no significant digit of it: ``e^{-200}`` is not 0, a 50-digit
decimal is not ``\\pi``): an identity test, not a proof, with the chance of a false match far below any benchmark's
resolution.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any, Optional, Sequence

MAX_CHARS = 256  # AIME / MATH answers are far shorter; a longer "answer" is compared as text
MAX_DIGITS = 10_000  # the largest power sympy is asked to compute exactly
MAX_ITEMS = 32  # entries of a set or list compared in any order
MAX_ROOT_DIGITS = 100  # the largest number sympy is asked to take a root of (\sqrt[7]{3^{6000}+1} took 25 s)
MAX_FACTORIAL = 3000  # the largest argument of a factorial or binomial (3000! has 9131 digits, under MAX_DIGITS)
MAX_NESTING = 3  # functions, roots and non-integer powers inside each other (sympy's evalf of nested logarithms,
# roots and powers of complex values re-evaluates the inner ones at each level: \log^8(5) never returned)
PRECISION = 60  # significant digits of the numerical identity test
DIGITS = 45  # the digits two values must share (the rest is evaluation error)
# the variables' values of the identity test: non-integers far from the poles of the usual answer forms
POINTS = ((0.5377, -1.3077, 2.7694), (1.8339, 0.3426, -0.4336), (-2.2588, 3.5784, 0.7254))

_FUNCTIONS = {"sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc", "ln": "log",
              "log": "log", "exp": "exp", "arcsin": "asin", "arccos": "acos", "arctan": "atan"}
_PERIODIC = {"sin", "cos", "tan", "cot", "sec", "csc"}  # evaluated by reducing the argument modulo pi
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "iota",
          "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi",
          "omega", "Gamma", "Delta", "Theta", "Lambda", "Xi", "Sigma", "Phi", "Psi", "Omega"}
# a repeating decimal 0.1\overline{6} is one number token (\bar too), before the plain numbers
_REPEATING = re.compile(r"(\d*)\.(\d*)\\(?:overline|bar)\s*(?:\{\s*(\d+)\s*\}|(\d))")
_TOKEN = re.compile(r"\s*(\d*\.\d*\\(?:overline|bar)\s*(?:\{\s*\d+\s*\}|\d)|\d+\.?\d*|\.\d+|\\[A-Za-z]+|\\.|\S)")
_WRAPPERS = ("\\text", "\\textbf", "\\textnormal", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox",
             "\\operatorname")
_BINOMIALS = ("\\binom", "\\dbinom", "\\tbinom")
_NOT_ATOMS = ("\\cdot", "\\times", "\\div", "\\cup", "\\choose")  # operators: no implicit product before them
_DEGREES = re.compile(r"(\^\s*\{?\s*\\circ\s*\}?|°)$")
_PERCENT = re.compile(r"\\?%$")
# "x = 5", "x \in [0, 1]", "f(x) = 2x", "f^{-1}(x, 2) = x/2", "(x, y) = (1, 2)": the value, named (not
# "x(x+1) = 0": an equation)
_VARIABLE = re.compile(r"^(?P<name>[A-Za-z](?:\^\{-1\}|\^-1)?(?:\s*\(\s*\w(?:\s*,\s*\w)*\s*\))?"
                       r"|\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])+\s*\))\s*(?:=(?!=)|\\in(?![A-Za-z]))")
# a vector or matrix (not vmatrix: a determinant), its rows split at \\, its entries at &
_MATRIX = re.compile(r"\\begin\s*\{([pb]?matrix)\}(.*)\\end\s*\{\1\}", re.DOTALL)
_SIGN_CHOICE = re.compile(r"\\(pm|mp)(?![A-Za-z])")  # 1 \pm \sqrt{2}: two values (not \pmod)
# 5\text{ million}, 5\text{ dozen}: a factor, never a unit
_SCALES = {"dozen": 12, "hundred": 10 ** 2, "thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9,
           "trillion": 10 ** 12}
# the words of a unit of measure or money (and "units", and a few count nouns that never change a value), singular:
# a trailing \text{} / \mathrm{} of them is formatting, 5\text{ cm} is 5 (MATH's answers drop it); a plural adds s or
# es; letters of one or two are matched in their case (m, L, mL), longer words in any. Any other trailing text is no
# unit: a letter is a variable (2\mathrm{x} is 2x, never 2), another word is refused (a place value, 5\text{ thousands
# place}: the digit 5 or 5000?; 2\text{ halves})
_UNIT_WORDS = frozenset((
    "m cm mm km in ft yd mi meter metre centimeter centimetre millimeter millimetre kilometer kilometre inch foot "
    "feet yard mile g mg kg lb oz gram milligram kilogram pound ounce ton tonne s ms h hr min sec second minute hour "
    "day week month year yr decade L l ml mL liter litre milliliter millilitre gallon gal quart pint cup acre "
    "hectare mph kph dollar cent euro rupee yen percent degree deg radian rad celsius fahrenheit kelvin unit way "
    "people person student").split())
_UNIT_JOINERS = ("square", "sq", "cubic", "per")  # square feet, miles per hour


class Refused(Exception):
    """The answer holds a construct this translation does not take, or one too large to compute."""


# --- cleaning ---------------------------------------------------------------------------------------------------

def unwrap(text: str, *, spaced: bool = False) -> str:
    """``\\text{km}`` -> ``km`` for the wrapper commands, innermost first; ``spaced`` keeps the content apart from
    its neighbours (``2\\text{cm}`` -> ``2 cm``) for the tokeniser."""
    for command in _WRAPPERS:
        pattern = re.compile(re.escape(command) + r"\s*\{([^{}]*)\}")
        while True:
            text, count = pattern.subn(r" \1 " if spaced else r"\1", text)
            if not count:
                break
    return text


_UNICODE = {"\u2212": "-", "π": "\\pi ", "∞": "\\infty ", "×": "\\times ", "·": "\\cdot ", "≤": "\\le ",
            "≥": "\\ge ", "≠": "\\ne "}


def latex_symbols(text: str) -> str:
    """``text`` with the Unicode maths symbols models write (``2π``, ``3×4``, a Unicode minus) as LaTeX."""
    for symbol, command in _UNICODE.items():
        text = text.replace(symbol, command)
    return text


def clean(answer: str) -> str:
    """LaTeX of an answer without what never changes its value: ``$``, ``\\left``/``\\right``, ``\\dfrac``, spacing
    commands, text wrappers (their content kept), a trailing full stop."""
    text = unwrap(latex_symbols(answer.strip()).replace("{,}", ","), spaced=True)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\cfrac", "\\frac").replace("\\!", "").replace("\\$", "").replace("$", "")
    text = text.replace("\\displaystyle", "").replace("\\mathbb{R}", "(-\\infty, \\infty)")
    for spacing in ("\\,", "\\;", "\\:", "\\ ", "~", "\\quad", "\\qquad"):
        text = text.replace(spacing, " ")
    return text.strip().rstrip(".").strip()


def _top_level(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside any bracket (``( [ {`` against ``) ] }``, so ``[0, 1)`` counts)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        char = text[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + len(separator)
            i = start
            continue
        i += 1
    parts.append(text[start:])
    return parts


# --- the expression parser ---------------------------------------------------------------------------------------

class _Parser:
    """Recursive descent over LaTeX tokens: expr := term (('+'|'-') term)* ['\\choose' expr]; term := unary
    (('*'|'/'|implicit) unary)*; unary := ('-'|'+') unary | power; power := atom '!'* ('^' exponent)*."""

    def __init__(self, text: str) -> None:
        import sympy

        self.sp = sympy
        self.tokens = _TOKEN.findall(text)  # every non-space character lands in a token
        self.at = 0
        self.bars = 0  # open |...|: a "|" closes one, it starts no product

    def parse(self) -> Any:
        value = self.expr()
        if self.at != len(self.tokens):
            raise Refused(f"unexpected {self.tokens[self.at]!r}")
        return value

    def peek(self) -> Optional[str]:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: Optional[str] = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise Refused(f"expected {expected or 'more'}, got {token!r}")
        self.at += 1
        return token

    def expr(self) -> Any:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        if self.peek() == "\\choose":  # {n \choose k}: the rest of the group is k
            self.take()
            return _combination(self.sp, value, self.expr())
        return value

    def term(self) -> Any:
        value = self.unary()
        while True:
            token = self.peek()
            if token in ("*", "\\cdot", "\\times"):
                self.take()
                value = value * self.unary()
            elif token in ("/", "\\div"):
                self.take()
                divisor = self.unary()
                if divisor == 0:
                    raise Refused("division by zero")
                value = value / divisor
            elif self._starts_atom(token) and not (token == "|" and self.bars):
                if _is_number(self.tokens[self.at - 1]) and (_is_number(token) or token == "\\frac"):
                    raise Refused("two numbers side by side, or a mixed number")
                value = value * self.power()
            else:
                return value

    def unary(self) -> Any:
        if self.peek() == "-":
            self.take()
            return -self.unary()
        if self.peek() == "+":
            self.take()
            return self.unary()
        return self.power(first=True)

    @staticmethod
    def _starts_atom(token: Optional[str]) -> bool:
        return token is not None and (token in ("(", "[", "{", "|") or _is_number(token) or token.isalpha()
                                      or (token.startswith("\\") and token[1:].isalpha()
                                          and token not in _NOT_ATOMS))

    def power(self, first: bool = False) -> Any:
        """``first``: the first factor of a product, where a mixed number may stand (not ``x 2\\frac{1}{2}``)."""
        value = self.mixed_number() if first else None
        value = self.atom() if value is None else value
        while self.peek() == "!":  # n!, (n+1)!; 5!! (a double factorial) is refused, not read as (5!)!
            self.take()
            if self.peek() == "!":
                raise Refused("a double factorial")
            value = _combination(self.sp, value)
        while self.peek() == "^":
            self.take()
            value = _power(self.sp, value, self.exponent())
        return value

    def mixed_number(self) -> Any:
        """``2\\frac{1}{2}`` (or ``2\\frac12``) as 5/2, as math-verify reads it, when unambiguous: an integer, a proper
        fraction of integers, and nothing after them that would multiply or raise the fraction alone
        (``2\\frac{1}{2}x``: 2 times x/2, or 5x/2?; ``2\\frac{1}{2}^2``); None otherwise (the term's side-by-side rule
        then refuses it)."""
        whole, rest = self.peek(), self.tokens[self.at + 1:self.at + 8]
        if whole is None or not whole.isdigit() or rest[:1] != ["\\frac"]:
            return None
        if rest[1:2] == ["{"] and rest[3:5] == ["}", "{"] and rest[6:7] == ["}"]:
            numerator, denominator, after = rest[2], rest[5], self.at + 8
        elif len(rest) > 1 and len(rest[1]) == 2:  # \frac12
            numerator, denominator, after = rest[1][0], rest[1][1], self.at + 3
        else:
            return None
        if not (numerator.isdigit() and denominator.isdigit() and 0 < int(numerator) < int(denominator)):
            return None
        following = self.tokens[after] if after < len(self.tokens) else None
        if following in ("^", "!", "_") or (self._starts_atom(following) and not (following == "|" and self.bars)):
            return None
        self.at = after
        return self.sp.Integer(whole) + self.sp.Rational(int(numerator), int(denominator))

    def exponent(self) -> Any:
        """``^{...}``, or one character: ``2^10`` is 2^1 followed by 0, as LaTeX typesets it."""
        token = self.peek()
        if token == "{":
            return self.group("{", "}")
        if token is not None and token[0].isdigit():
            self.take()
            if len(token) > 1:  # "^10": the exponent is its first digit, the rest follows it
                self.tokens.insert(self.at, token[1:])
            return self.sp.Integer(token[0])
        if token == "-":
            self.take()
            return -self.exponent()
        return self.atom()

    def group(self, opening: str, closing: str) -> Any:
        self.take(opening)
        value = self.expr()
        self.take(closing)
        return value

    def argument(self) -> Any:
        """A command's argument: ``{...}``, else one token (``\\frac12``, ``\\sqrt2``)."""
        if self.peek() == "{":
            return self.group("{", "}")
        token = self.take()
        if _is_number(token):
            if len(token) > 1 and "." not in token:
                self.tokens.insert(self.at, token[1:])
                token = token[0]
            return _number(self.sp, token)
        self.at -= 1
        return self.atom()

    def atom(self) -> Any:
        sp = self.sp
        token = self.take()
        if _is_number(token):
            return _number(sp, token)
        if token in ("(", "[", "{"):
            return self.group_rest(token)
        if token == "|":
            self.bars += 1
            value = self.expr()
            self.take("|")
            self.bars -= 1
            return sp.Abs(value)
        if token == "\\frac":
            numerator = self.argument()
            denominator = self.argument()
            if denominator == 0:
                raise Refused("division by zero")
            return numerator / denominator
        if token == "\\sqrt":
            degree = None
            if self.peek() == "[":
                degree = self.group("[", "]")
            radicand = self.argument()  # \sqrt[3]{-8} is -2 (_power: the real odd root)
            return _power(sp, radicand, sp.Rational(1, 2) if degree is None else 1 / _nonzero(degree))
        if token in _BINOMIALS:
            return _combination(sp, self.argument(), self.argument())
        if token == "\\pi":
            return sp.pi
        if token == "\\infty":
            return sp.oo
        if token == "e":
            return sp.E
        if token == "i":
            return sp.I
        if token.startswith("\\") and token[1:] in _FUNCTIONS:
            return self.function(token[1:])
        if token.startswith("\\") and token[1:] in _GREEK:
            return self.subscripted(token[1:])
        if len(token) == 1 and token.isalpha():
            return self.subscripted(token)
        raise Refused(f"unsupported {token!r}")

    def group_rest(self, opening: str) -> Any:
        value = self.expr()
        self.take({"(": ")", "[": "]", "{": "}"}[opening])
        return value

    def subscripted(self, name: str) -> Any:
        if self.peek() == "_":
            self.take()
            index = self.take()
            if index == "{":
                parts = []
                while self.peek() not in ("}", None):
                    parts.append(self.take())
                self.take("}")
                index = "".join(parts)
            name = f"{name}_{index}"
        return self.sp.Symbol(name)

    def function(self, name: str) -> Any:
        sp = self.sp
        base = None
        if name == "log" and self.peek() == "_":
            self.take()
            base = self.argument()
        exponent = None
        if self.peek() == "^":  # \sin^2 x
            self.take()
            exponent = self.exponent()
        if self.peek() in ("(", "{"):
            argument = self.group_rest(self.take())
        else:
            argument = self.power()
        if name == "log" and base is None:
            base = sp.Integer(10)  # a bare \log is the common logarithm, as math-verify and Qwen2.5-Math read it
        if name == "exp":  # e^x, bounded as every power is
            value = _power(sp, sp.E, argument)
        elif base is None:
            if name in _PERIODIC and _may_be_large(sp, argument) and _size(sp, argument) > MAX_DIGITS:
                raise Refused("a function of a number too large")  # sin(e^{10^5}) reduces it modulo pi to 10^5 digits
            value = getattr(sp, _FUNCTIONS[name])(argument)
        else:
            value = sp.log(argument) / sp.log(_nonzero(base))
        return _nested(sp, value) if exponent is None else _power(sp, value, exponent)


def _is_number(token: str) -> bool:
    return token[:1].isdigit() or (token[:1] == "." and len(token) > 1)  # ".5", ".\overline{3}"


def _number(sympy: Any, token: str) -> Any:
    if len(token) > MAX_DIGITS:
        raise Refused("a number too long")
    repeating = _REPEATING.fullmatch(token)
    if repeating is None:
        return sympy.Rational(token)  # a decimal is its exact value: 0.5 is 1/2
    whole, fixed, period = repeating.group(1) or "0", repeating.group(2), repeating.group(3) or repeating.group(4)
    # 0.1\overline{6} = 0.1 + 6 / (10 * 9): the period repeats from the digit after the fixed ones
    return sympy.Rational(f"{whole}.{fixed or 0}") + \
        sympy.Rational(int(period), 10 ** len(fixed) * (10 ** len(period) - 1))


def _combination(sympy: Any, n: Any, k: Any = None) -> Any:
    """``n!`` (``k`` None) or the binomial coefficient ``C(n, k)``, of natural numbers up to MAX_FACTORIAL (sympy
    computes them exactly as it builds them), or of expressions in variables up to MAX_FACTORIAL at the identity
    test's points (``(n+1)!``, ``\\binom{n}{2}``: sympy's gamma function evaluates them there)."""
    for argument in (n,) if k is None else (n, k):
        if argument.is_number:
            if not (argument.is_Integer and 0 <= argument <= MAX_FACTORIAL):
                raise Refused("a factorial or binomial of no natural number up to MAX_FACTORIAL")
        elif _size(sympy, argument) > math.log10(MAX_FACTORIAL):
            raise Refused("a factorial or binomial of an expression too large")
    return _nested(sympy, sympy.factorial(n) if k is None else sympy.binomial(n, k))


def _depth(sympy: Any, value: Any) -> int:
    """How deep functions (``\\log``, ``\\sin``, ``|x|``, ``n!``) and powers with a non-integer exponent (roots) nest
    in ``value``: ``\\sqrt{2 + \\sqrt{3}}`` is 2, ``\\log(x)`` (log(x) / log(10)) 1."""
    own = isinstance(value, sympy.Function) or (value.is_Pow and not value.exp.is_Integer)
    return int(own) + max((_depth(sympy, arg) for arg in value.args), default=0)


def _nested(sympy: Any, value: Any) -> Any:
    """``value``, refused when it nests over MAX_NESTING deep (``_depth``): sympy's evalf re-evaluates the inner levels
    of nested logarithms, roots and powers of complex values at each level, so the time grows about tenfold a level."""
    if _depth(sympy, value) > MAX_NESTING:
        raise Refused("functions or roots nested too deep")
    return value


def _nonzero(value: Any) -> Any:
    if value == 0:
        raise Refused("division by zero")
    return value


def _digits(value: Any) -> float:
    """log10 of a rational's size (numerator or denominator, whichever is larger), from its bit lengths."""
    p, q = abs(int(value.p)), int(value.q)
    return max(p.bit_length(), q.bit_length()) * math.log10(2)


def _power(sympy: Any, base: Any, exponent: Any) -> Any:
    """``base ** exponent``, refused when sympy could compute exact numbers of over MAX_DIGITS digits: it evaluates
    a rational to a rational power as it builds it, and distributes one over a product's rational parts
    (``(\\sqrt{2})^{10^9}`` is 2^{5 10^8}), so ``9^{9^{9^9}}`` would never return. The bound: the exponent times the
    digits of the base's rationals (at least 1). Any other exponent (``2^{\\pi 10^9}``, ``e^{e^{e^9}}``) is kept
    unevaluated, but the comparison's evalf needs it to as many digits as the value has: the same bound, on the
    exponent's size times the base's digits (at least 1), at the identity test's points."""
    if base == 0 and exponent.is_number and exponent.is_negative:
        raise Refused("division by zero")
    if exponent.is_Rational and exponent.q % 2 == 1 and not exponent.is_Integer and base.is_number and \
            base.is_extended_negative:  # the real value: (-8)^{1/3} is -2, (-8)^{2/3} 4, not sympy's principal root
        return (-1) ** exponent.p * _power(sympy, -base, exponent)
    if exponent.is_Rational and base not in (0, 1, -1):
        size = max(1.0, sum(_digits(r) for r in base.atoms(sympy.Rational)))
        if abs(float(exponent)) * size > MAX_DIGITS:
            raise Refused("a power too large")
        if not exponent.is_Integer and size > MAX_ROOT_DIGITS:
            raise Refused("a root of a number too large")  # sympy factors it looking for perfect powers
    elif base not in (0, 1, -1):
        if _size(sympy, exponent) + math.log10(max(1.0, abs(_size(sympy, base)))) > math.log10(MAX_DIGITS):
            raise Refused("a power too large")
    return _nested(sympy, sympy.Pow(base, exponent))


def _may_be_large(sympy: Any, value: Any) -> bool:
    """Whether ``value`` holds a power, a factorial or an integer of over 15 digits: only then can it exceed MAX_DIGITS
    digits (and _size, evaluating it, is spared for the rest: nested ``\\sin`` would cost it quadratic time)."""
    return value.has(sympy.Pow, sympy.exp, sympy.factorial, sympy.binomial) or \
        any(_digits(r) > 15 for r in value.atoms(sympy.Rational))


def _size(sympy: Any, value: Any) -> float:
    """log10 of ``|value|``, the largest over the identity test's points (every assignment of their coordinates to
    the variables, as the comparison may take any); inf when it cannot be evaluated (an infinity, over three
    variables), -inf for 0. The parts of ``value`` passed these bounds, so this evaluation is quick."""
    symbols = sorted(value.free_symbols, key=str)
    if len(symbols) > len(POINTS[0]):
        return math.inf
    largest = -math.inf
    for point in POINTS:
        for coordinates in itertools.permutations(point, len(symbols)):
            number = value.evalf(15, subs={s: sympy.Float(c) for s, c in zip(symbols, coordinates)})
            if not (number.is_number and number.is_finite):
                return math.inf
            if number != 0:
                largest = max(largest, float(sympy.log(abs(number), 10).evalf(15)))
        if not symbols:
            break
    return largest


def expression(text: str) -> Any:
    """The sympy value of one LaTeX expression; Refused when it holds anything outside the module's list."""
    return _Parser(text).parse()


# --- answers: expressions, tuples, sets, equations ---------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    """One parsed answer: ``kind`` expr (``value``), tuple (``brackets``, ``items``), set or union (``items``; the
    two values of a ``\\pm`` expression are a set with ``brackets`` ``\\pm``, spliced into a list holding it), eq
    (``value`` is lhs - rhs; ``stated`` its right side when that is a non-zero number, ``m + n = 25``: 25;
    ``assigned`` when its left side is variables alone, ``m + n``, ``m/n``, not ``x^2 + y^2``);
    ``percent`` when it ended in a percent sign; ``unit`` its trailing unit, or ""; ``variable`` the letter of a
    leading ``x =``, or "" (``x = 3`` is 3, but not ``y = 3``)."""

    kind: str
    value: Any = None
    items: tuple["Answer", ...] = ()
    brackets: str = ""
    percent: bool = False
    unit: str = ""
    variable: str = ""
    stated: Any = None
    assigned: bool = False


# a unit: \text{ cm}, \mathrm{m} (siunitx's \unit{cm} too), or plain words of two letters or more (2 cm, 3 hours: one
# letter is a variable, 2g is 2 g), with a square or cube: \text{ cm}^2, 4 cm^2. Plain words: up to 8 of up to 16
# letters (5 hundred thousand square feet per hour; millilitres): unbounded, the search tried each word of a long
# run as a unit's start, to the end (quadratic: 27 s for a box looping on a phrase 4000 times, 68k characters)
_UNIT_FORM = (r"(?:\\(?:text|textnormal|textrm|mbox|mathrm|unit)\s*\{\s*([A-Za-z][A-Za-z\s]*?)\s*\}"
              r"|(?<![\\A-Za-z])([A-Za-z]{2,16}(?:\s+[A-Za-z]{2,16}){0,7}))(?:\s*\^\s*(?:\{\s*([23])\s*\}|([23])))?")
_UNIT = re.compile(_UNIT_FORM + r"[\s.$]*$")  # the unit that ends an answer
# a unit that ends an entry of a tuple, set or list: (2\text{ cm}, 3\text{ cm})
_ENTRY_UNIT = re.compile(_UNIT_FORM + r"(?=\s*(?:,|\\right|\\\}|[)\]]|$))")
# words: a text wrapper holding two letters in a row, or three letters in a row outside a command (\\sqrt, \\pi)
_WORDS = re.compile(r"\\(?:text\w*|mbox|mathrm|mathbf|operatorname)\s*\{[^{}]*[A-Za-z]{2}|(?<![\\A-Za-z])[A-Za-z]{3}")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_AND = re.compile(r",?\s*(?:\\text\s*\{\s*and\s*\}|\band\b)\s*")  # "6 \text{ and } 8" lists 6, 8


def scale_factor(word: str) -> Optional[Fraction]:
    """The number a scale word multiplies by (``thousand``, ``Millions``, ``dozen``: 1000, 10^6, 12;
    ``thousandths``: 1/1000), else None."""
    word = word.lower().removesuffix("s")
    if word.endswith("th") and word[:-2] in _SCALES and word[:-2] != "dozen":  # no "dozenths"
        return Fraction(1, _SCALES[word[:-2]])
    return Fraction(_SCALES[word]) if word in _SCALES else None


def _unit_word(word: str) -> bool:
    """Whether ``word`` names a unit (``_UNIT_WORDS``), in the singular or plural."""
    forms = (word, word.lower()) if len(word) > 2 else (word,)
    return any(form in _UNIT_WORDS or (form.endswith("s") and form[:-1] in _UNIT_WORDS) or
               (form.endswith("es") and form[:-2] in _UNIT_WORDS) for form in forms)


@dataclass(frozen=True)
class Unit:
    """The trailing unit of an answer: where its wrapper starts, the factor of its leading scale words (``5\\text{
    thousand dollars}``: 1000), and its name (``dollars``; ``cm^2``; "" for scale words alone)."""

    start: int
    factor: Fraction
    name: str


def trailing_unit(answer: str) -> Optional[Unit]:
    """The unit that ends ``answer`` after a value (``5\\text{ cm}``, ``5\\text{ hundred thousand}``, ``4\\text{
    cm}^2``); None when it ends in none, or in a wrapper whose words are no unit (``2\\mathrm{x}``, ``5\\text{
    thousands place}``): that text is then part of the value (a variable, or refused as words)."""
    found = _UNIT.search(answer)
    return None if found is None or not answer[:found.start()].strip() else _unit(found)


def _unit(found: re.Match[str]) -> Optional[Unit]:
    """The unit ``_UNIT_FORM`` matched, None when its words name none."""
    words, factor = (found.group(1) or found.group(2)).split(), Fraction(1)
    while words and (scale := scale_factor(words[0])) is not None:  # 5 hundred thousand: 5 10^5
        factor *= scale
        words.pop(0)
    power = found.group(3) or found.group(4)
    if words and not (_unit_word(words[-1]) and all(_unit_word(w) or w in _UNIT_JOINERS for w in words)) or \
            (power and not words):
        return None
    return Unit(found.start(), factor, " ".join(words) + (f"^{power}" if power else ""))


def _entry_units(text: str) -> str:
    """``text`` with the unit that ends each entry of a tuple, set or list as ``\\unit{...}``, which cleaning keeps
    (``(2\\text{ cm}, 3\\mathrm{g})``: ``(2\\unit{cm}, 3\\unit{g})``; each entry's unit is then read as a single
    value's). Scale words stay (``1, 2\\text{ million}`` is refused), and so does text that names no unit."""
    def marked(found: re.Match[str]) -> str:
        unit = _unit(found)
        if unit is None or unit.factor != 1 or not unit.name or not text[:found.start()].strip():
            return found.group(0)
        name, _, power = unit.name.partition("^")
        return f"\\unit{{{name}}}" + (f"^{power}" if power else "")
    return _ENTRY_UNIT.sub(marked, text)


def parse_answer(answer: str) -> Optional[Answer]:
    """The structure and values of ``answer``; None when any part of it is refused (see the module docstring)."""
    if len(answer) > MAX_CHARS:
        return None
    try:
        return _answer(_AND.sub(", ", answer.strip()), top=True)
    except (Refused, RecursionError, ValueError, TypeError, ZeroDivisionError, OverflowError):
        return None


def _answer(raw: str, top: bool = False) -> Answer:
    """``raw`` without its trailing unit parsed (``_structure``), the unit set on it; the leading scale words of the
    unit (``5\\text{ million}``, ``5\\text{ thousand dollars}``, ``5\\text{ hundred thousand}``, ``5\\text{
    thousandths}``, ``5\\text{ dozen}``) are factors, never dropped: 5 thousand is not 5."""
    unit = trailing_unit(raw)
    answer = _structure(raw if unit is None else raw[:unit.start], top)
    if unit is None:
        return answer
    if unit.factor != 1:
        import sympy

        if answer.kind != "expr":
            raise Refused("a scale word after a list or an equation")
        answer = replace(answer, value=answer.value * sympy.Rational(unit.factor.numerator, unit.factor.denominator))
    if unit.name.lower().removesuffix("s") == "percent":  # the percent sign in words: 25\text{ percent} is 25\%
        return replace(answer, percent=True)  # (as a unit, 2500\% / 100 equalled it)
    return replace(answer, unit=answer.unit or unit.name)


def _structure(raw: str, top: bool) -> Answer:
    matrix = _MATRIX.fullmatch(raw.strip().strip("$").strip())
    if matrix is not None:  # compared entry by entry, as a tuple of rows
        rows = re.split(r"\\\\", matrix.group(2).strip())
        rows = rows[:-1] if len(rows) > 1 and not rows[-1].strip() else rows  # a final \\
        if len(rows) * max(row.count("&") + 1 for row in rows) > MAX_ITEMS:
            raise Refused("a matrix too large")
        return Answer("tuple", brackets="matrix", items=tuple(
            Answer("tuple", brackets="row", items=tuple(_answer(entry) for entry in row.split("&"))) for row in rows))
    raw = _entry_units(raw)
    unitless = re.sub(r"\\unit\s*\{[^{}]*\}", "", raw)
    if _WORDS.search(unitless) or _WORDS.search(clean(unitless)):
        raise Refused("words")  # "\\text{east}" is no product e*a*s*t ("seat" would equal it)
    text = clean(raw)
    if "!=" in text:
        raise Refused("an inequation")  # x != 3 is no equation x! = 3
    text = _DEGREES.sub("", text).strip()
    percent = _PERCENT.search(text) is not None
    text = _PERCENT.sub("", text).strip()
    named = _VARIABLE.match(text) if top else None
    name = "".join(named.group("name").split()) if named is not None else ""
    if name.startswith("(") and name[1:-1].split(",") != sorted(name[1:-1].split(",")):
        raise Refused("a pair named out of order")  # (y, x) = (1, 2) is the pair (x, y) = (2, 1): not (1, 2)
    value = _answer(text[named.end():].strip()) if named is not None and "=" not in text[named.end():] else None
    # "x = 5" is 5 ("x = y = 5" is refused below); "x = 2x + 1" is an equation in x, not the value 2x + 1
    if value is not None and not (len(name) == 1 and _holds(value, name)):
        if value.kind == "set":  # x = \pm 2, x = 1, 2: each value is x's (not y's)
            items = tuple(replace(item, variable=item.variable or name) for item in value.items)
            value = replace(value, items=items)
        return replace(value, percent=value.percent or percent, variable=name)
    if not text:
        raise Refused("empty")
    union = _top_level(text, "\\cup")
    if len(union) > 1:
        return Answer("union", items=tuple(_answer(part) for part in union))
    if _THOUSANDS.fullmatch(text):  # 1,000 (a comma followed by a space, "1, 234", is a list)
        return Answer("expr", value=expression(text.replace(",", "")), percent=percent)
    items = _entries(text)
    if len(items) > 1:  # a list of values or of equations: 1, 2 or x = 1, x = 2 or k = 45, n = 2
        return Answer("set", items=_spliced(_answer(part, top=True) for part in items))
    sides = _top_level(text, "=")
    if len(sides) == 2:
        import sympy

        left, right = expression(sides[0]), expression(sides[1])
        difference = left - right
        if not difference.free_symbols and not right.free_symbols and _equal(left, right):
            return Answer("expr", value=right, percent=percent)  # 3 \times 4 = 12 states 12
        if not difference.free_symbols or _equal(difference, sympy.S.Zero):  # 0 = 1, x = x, x(x+1) = x^2 + x
            raise Refused("an equation that holds for every value or none")  # no relation: compared as text
        stated = right if right.is_number and right != 0 else None  # m + n = 25 states 25; x - 5 = 0 nothing
        # assigned: m + n, m - n, m/n, not x^2 + y^2, 2x + 3y, k + 1 (only -1 as a sign or reciprocal)
        assigned = not (left.atoms(sympy.Number) - {sympy.S.NegativeOne}) and \
            not any(term.is_number for term in sympy.Add.make_args(left))
        return Answer("eq", value=difference, stated=stated, assigned=assigned)
    if len(sides) > 2:
        raise Refused("a chain of equations")
    if text.startswith("\\{") and text.endswith("\\}"):
        return Answer("set", items=_spliced(_answer(part) for part in _entries(text[2:-2])))
    if text[0] in "([" and text[-1] in ")]" and _encloses(text):
        inner = _entries(text[1:-1])
        if len(inner) > 1:
            if _SIGN_CHOICE.search(text):
                raise Refused("a tuple with \\pm")  # (\pm 1, \pm 2): two points or four?
            return Answer("tuple", items=tuple(_answer(part) for part in inner), brackets=text[0] + text[-1])
    if _SIGN_CHOICE.search(text):  # 1 \pm \sqrt{2}: both signs, every \pm the same (\mp the other)
        signs = ({"pm": "+", "mp": "-"}, {"pm": "-", "mp": "+"})
        values = (expression(_SIGN_CHOICE.sub(lambda m, s=sign: s[m.group(1)], text)) for sign in signs)
        return Answer("set", items=tuple(Answer("expr", value=value) for value in values), brackets="\\pm")
    return Answer("expr", value=expression(text), percent=percent)


def _holds(answer: Answer, name: str) -> bool:
    """Whether the variable ``name`` occurs in ``answer``'s values."""
    values = [answer.value] if answer.value is not None else []
    return any(str(s) == name for v in values for s in v.free_symbols) or any(_holds(i, name) for i in answer.items)


def _spliced(answers: Any) -> tuple[Answer, ...]:
    """A list's items, the two values of each ``\\pm`` item in its place; refused past MAX_ITEMS."""
    items: list[Answer] = []
    for answer in answers:
        items.extend(answer.items if answer.kind == "set" and answer.brackets == "\\pm" else (answer,))
    if len(items) > MAX_ITEMS:
        raise Refused("a list too long")
    return tuple(items)


def _entries(text: str) -> list[str]:
    """``text`` split at its top-level commas; refused past MAX_ITEMS entries (sets are matched item against item)."""
    items = _top_level(text, ",")
    if len(items) > MAX_ITEMS:
        raise Refused("a list too long")
    return items


def _encloses(text: str) -> bool:
    """Whether the first bracket of ``text`` closes at its last character (``(1, 2)``, ``[0, 1)``), not before
    (``(1)(2)``)."""
    depth = 0
    for i, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0:
            return i == len(text) - 1
    return False


def equivalent(predicted: str, reference: str) -> bool:
    """Whether two answers are the same (the module docstring's rule); False when either cannot be translated."""
    a, b = parse_answer(predicted), parse_answer(reference)
    return a is not None and b is not None and _same(a, b)


def _same(a: Answer, b: Answer) -> bool:
    if a.unit and b.unit and a.unit != b.unit:
        return False  # 5 cm is not 5 m
    if a.variable and b.variable and a.variable != b.variable:  # the line x = 3 is not y = 3, but y = x is x = y
        return a.kind == b.kind == "expr" and _proportional(_equation(a), _equation(b))
    if a.kind != b.kind:  # x - 3 = 0 is x = 3 (not 3 alone: an equation is no value, but m + n = 25 states 25)
        named = a if a.kind == "expr" else b
        equation = b if named is a else a
        if {a.kind, b.kind} != {"eq", "expr"} or named.percent:
            return False
        if not named.variable:  # the model's m + n = 25 states 25; a reference only when it assigns (not x^2 + y^2 = 25)
            return equation.stated is not None and (named is b or equation.assigned) and \
                _equal(equation.stated, named.value)
        return _proportional(equation.value, _equation(named))
    if a.kind == "expr":
        if a.percent != b.percent:  # 25\% against 25 or against 0.25
            percent, other = (a, b) if a.percent else (b, a)
            return _equal(percent.value, other.value) or _equal(percent.value / 100, other.value)
        return _equal(a.value, b.value)
    if a.kind == "eq":
        return _proportional(a.value, b.value)
    if a.kind == "tuple":
        return a.brackets == b.brackets and len(a.items) == len(b.items) and \
            all(_same(x, y) for x, y in zip(a.items, b.items))
    return _matched(a.items, b.items)  # set, union: in any order


def _matched(xs: Sequence[Answer], ys: Sequence[Answer]) -> bool:
    """Each item of ``xs`` equal to its own item of ``ys`` (same count)."""
    if len(xs) != len(ys):
        return False
    left = list(ys)
    for x in xs:
        match = next((i for i, y in enumerate(left) if _same(x, y)), None)
        if match is None:
            return False
        left.pop(match)
    return True


def _equation(named: Answer) -> Any:
    """``x = v`` as the lhs - rhs of an equation: x - v."""
    import sympy

    return sympy.Symbol(named.variable) - named.value


def _proportional(a: Any, b: Any) -> bool:
    """Whether the equations ``a = 0`` and ``b = 0`` are the same one scaled: ``a`` is a non-zero constant times
    ``b`` (``2x = 6`` is ``x = 3``, ``y = 2x + 1`` is ``2x - y + 1 = 0``; ``(x - 3)^2 = 0`` is not ``x = 3``, whose
    solution set it shares: equations are not solved); an equation in no variable is none. First, exactly, term by
    term (``_term_factor``: ``\\sqrt{3}x + \\sqrt{3}y = \\sqrt{3}`` is ``x + y = 1`` scaled, without evaluating
    anything). Else by values: ``a`` and ``b`` must each be provably non-zero at two of the identity test's points at
    least (both 0 at two points, every pair would compare 0 with 0: ``|x| = x`` is not ``y|x| = xy``, and ``2|x| = 2x``
    is refused with it); a small fraction ``a / b`` takes at a point is tried (``_small_ratio``: sympy cancels ``a - 2
    b`` as it builds it); then ``a / b`` must take one value at the three points (``_same_ratio``). Not through
    derivatives (``a' b = a b'`` in every variable): those of factorials and binomials are polygamma functions, whose
    evaluation took 1-3 s an equation in three variables."""
    import sympy

    variables = sorted(a.free_symbols | b.free_symbols, key=str)
    if variables and _term_factor(sympy, a, b, variables) is not None:
        return True
    if _equal(a, b) or _equal(a, -b):
        return True
    if not variables or len(variables) > len(POINTS[0]) or not all(
            sum(_nonzero_at(sympy, side, {v: sympy.Float(c, PRECISION) for v, c in zip(variables, point)})
                for point in POINTS) >= 2 for side in (a, b)):
        return False  # each pair of points holds one where a and b are 0: 0 = 0 at every pair (|x| = x, y|x| = xy)
    factor = _small_ratio(sympy, a, b, variables)
    if factor is not None and _equal(a, factor * b):
        return True  # a = 2 b: sympy cancels a - 2 b as it builds it
    return _same_ratio(sympy, a, b, variables)


def _term_factor(sympy: Any, a: Any, b: Any, variables: Sequence[Any]) -> Optional[Any]:
    """The constant ``c`` with ``a = c b`` term by term: the terms of both sums, each split into a constant and a part
    in the variables, have the same parts, and each of ``a``'s constants is ``c`` times ``b``'s in sympy's canonical
    form (``\\sqrt{3}/\\sqrt{3}`` is 1 as sympy builds it); None otherwise (the value tests then decide). A proof,
    not a test: ``a = sum c_k t_k = c sum d_k t_k = c b``."""
    def terms(side: Any) -> dict[Any, Any]:
        split: dict[Any, Any] = {}
        for term in sympy.Add.make_args(side):
            constant, part = term.as_independent(*variables, as_Add=False)
            split[part] = split.get(part, 0) + constant
        return split

    x, y = terms(a), terms(b)
    if x.keys() != y.keys() or any(value == 0 for value in y.values()):
        return None
    ratios = {x[part] / y[part] for part in x}
    factor = ratios.pop() if len(ratios) == 1 else None
    return factor if factor is not None and factor.is_number and factor.is_finite and factor != 0 else None


def _same_ratio(sympy: Any, a: Any, b: Any, variables: Sequence[Any]) -> bool:
    """Whether ``a / b`` takes one value at the identity test's points: ``a(p) b(q) = a(q) b(p)`` for each two points
    where both are finite, to all but 15 of the digits computed. The values are computed once a point to
    ``2 PRECISION`` digits past the digits of the rationals in ``a`` and ``b`` (up to MAX_CHARS), the precision
    ``_nonzero_at`` tries, so a term tiny against the rest (``10^{-60} z``) is still told apart. This replaced sympy's
    strict evaluation of each product difference, which is 0 for proportional sides and so ran to its last digit:
    about 1 s a pair for an equation of binomials, 1.3 s to 4 s a comparison (measured on the test machine)."""
    digits = min(sum(_digits(r) for side in (a, b) for r in side.atoms(sympy.Rational)), MAX_CHARS)
    precision = int(2 * PRECISION + digits)
    tolerance = sympy.Float(10, precision) ** (15 - precision)
    values = []
    try:
        for point in POINTS:
            at = {v: sympy.Float(c, precision) for v, c in zip(variables, point)}
            x, y = a.evalf(precision, subs=at), b.evalf(precision, subs=at)
            if x.is_number and y.is_number and x.is_finite and y.is_finite:
                values.append((x, y))
        pairs = list(itertools.combinations(values, 2))
        return bool(pairs) and all(abs(xp * yq - xq * yp) <= tolerance * max(abs(xp * yq), abs(xq * yp))
                                   for (xp, yp), (xq, yq) in pairs)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, RecursionError, AttributeError):
        return False


def _small_ratio(sympy: Any, a: Any, b: Any, variables: Sequence[Any]) -> Optional[Any]:
    """``a / b`` at the first of the identity test's points where both are finite and non-zero, as the nearest
    fraction of denominator up to 1000 (``2x = 6`` against ``x = 3``: 2), the factor to try first; None when it is no
    real number. Only a candidate: ``_equal(a, factor * b)`` decides, at every point."""
    for point in POINTS:
        values = {v: sympy.Float(c, PRECISION) for v, c in zip(variables, point)}
        x, y = a.evalf(PRECISION, subs=values), b.evalf(PRECISION, subs=values)
        if x.is_number and y.is_number and x.is_finite and y.is_finite and x != 0 and y != 0:
            ratio = (x / y).evalf(PRECISION)
            if not ratio.is_real:
                return None
            factor = Fraction(str(ratio)).limit_denominator(1000)
            return sympy.Rational(factor.numerator, factor.denominator) if factor else None
    return None


def _nonzero_at(sympy: Any, difference: Any, values: dict[Any, Any]) -> bool:
    """Whether ``difference`` at ``values`` is provably not 0: sympy's evalf finds PRECISION significant digits of it
    (raising its working precision as terms cancel), where an identity's terms cancel to every digit it tries. This
    keeps the tolerance above from taking a tiny value for 0 (``e^{-200}``), or a 50-digit decimal for ``\\pi``: the
    precision it tries is twice PRECISION past the digits of the rationals in the answer (a decimal, a power), those
    counted up to MAX_CHARS (a decimal has no more; a huge integer factor, 9^{4000}, scales both sides alike)."""
    from sympy.core.evalf import PrecisionExhausted

    digits = min(sum(_digits(r) for r in difference.atoms(sympy.Rational)), MAX_CHARS)
    try:
        value = difference.evalf(PRECISION, subs=values, strict=True, maxn=int(2 * PRECISION + digits))
    except (PrecisionExhausted, ValueError):  # ValueError: sympy printing a huge integer into PrecisionExhausted's text
        return False  # the terms cancel to every digit tried: 0 as far as evaluation can tell
    return bool(value != 0)


def _equal(a: Any, b: Any) -> bool:
    """Exact when the difference is rational; else the identity test at POINTS (module docstring)."""
    import sympy

    try:
        if a == b:
            return True
        difference = a - b
        if difference == 0:
            return True
        if difference.is_Rational:
            return False
        symbols = sorted(difference.free_symbols, key=str)
        if len(symbols) > len(POINTS[0]):
            return False
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, RecursionError, AttributeError):
        return False
    return _agree(sympy, a, b, [dict(zip(symbols, point)) for point in (POINTS if symbols else POINTS[:1])])


def _agree(sympy: Any, a: Any, b: Any, points: Sequence[dict[Any, float]]) -> bool:
    """Whether ``a`` and ``b`` have the same value at each of ``points`` (its variables' values) where both are
    finite, and at one at least: to DIGITS digits, their difference not provably non-zero (``_nonzero_at``). A number
    is evaluated once: every point gives it the same value."""
    try:
        difference = a - b
        tolerance = sympy.Float(10) ** -DIGITS
        tested = 0
        for point in points:
            values = {s: sympy.Float(v, PRECISION) for s, v in point.items()}
            x, y = a.evalf(PRECISION, subs=values), b.evalf(PRECISION, subs=values)
            if not (x.is_number and y.is_number and x.is_finite and y.is_finite):
                continue  # a pole, or a value sympy cannot evaluate: this point tells nothing
            if abs(x - y) > tolerance * max(1, abs(x), abs(y)) or _nonzero_at(sympy, difference, values):
                return False
            tested += 1
        return tested > 0
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, RecursionError, AttributeError):
        return False
