"""The boxed scorer's answer equivalence (spade_mega/evaluation/symbolic.py, docs/evaluation.md "Scorers"): forms of
the same value score, different values do not (including those a lax checker takes: a numerical tolerance, a
percentage read three ways), hedges score 0 in every scorer, and a pathological answer is refused at once."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spade_mega.evaluation.scoring import (MAX_ANSWERS, MAX_NESTED_BOXES, SCORERS, boxed_answers, final_answer,
                                          stated_answers)
from spade_mega.evaluation.symbolic import MAX_CHARS, MAX_FACTORIAL, MAX_ITEMS, expression, parse_answer

SAME = [  # (answer the model boxed, reference)
    ("2^{10}", "1024"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("\\dfrac{\\pi}{2}", "\\frac12\\pi"),
    ("0.5", "\\frac{1}{2}"),
    ("\\tfrac{3}{4}", "0.75"),
    ("\\sqrt[3]{16}", "2\\sqrt[3]{2}"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),  # a rationalised denominator
    ("2 \\cdot 3^{2}", "18"),
    ("4 \\times \\pi", "4\\pi"),
    ("3\\pi", "\\pi \\cdot 3"),
    ("\\left( 3, -\\frac{1}{2} \\right)", "(3, -0.5)"),  # tuples element by element
    ("(-\\infty, 3]", "\\left(-\\infty,3\\right]"),  # intervals: the brackets and the ends
    ("(-\\infty, 1) \\cup (2, \\infty)", "(2,\\infty)\\cup(-\\infty,1)"),
    ("-2, 1", "1, -2"),  # "all the solutions": a list in any order
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}"),
    ("(1, 2), (3, 4)", "(3,4),(1,2)"),
    ("25\\%", "25"),  # MATH's answers drop the percent sign
    ("25\\%", "0.25"),  # or give the fraction
    ("30^\\circ", "30"),
    ("\\frac{\\pi}{6}", "\\frac{\\pi}{6}"),
    ("x^2 + 1", "1 + x^{2}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("\\frac{x}{7}+\\frac{2}{7}", "\\frac{x+2}{7}"),
    ("y = 2x + 1", "2x+1"),  # "y =" before the value
    ("x=5", "x = 5"),
    ("x + y = 1", "1 - x - y = 0"),  # equations: lhs - rhs up to sign
    ("\\sin^2 \\theta + \\cos^2 \\theta", "1"),
    ("\\log_2 8", "3"),
    ("e^{i\\pi}", "-1"),
    ("3+4i", "4i+3"),
    ("|-3|", "3"),
    ("2\\sqrt{2}\\text{ cm}", "\\sqrt{8}"),
    ("\\$1{,}000", "1000"),
    ("10,\\!000", "10^4"),
    ("9^{4000} 9^{4000} (\\sqrt{2} + 1)^2", "(3 + 2\\sqrt{2}) 9^{8000}"),  # terms cancelling past a 7634-digit factor
    # \pm: the set of both values (every \pm the same sign, \mp the other), spliced into a list holding it
    ("\\pm 2", "2, -2"),
    ("x = \\pm 2", "-2, 2"),
    ("x = \\pm 2", "x = 2, x = -2"),
    ("1 \\pm \\sqrt{19}", "1 - \\sqrt{19}, 1 + \\sqrt{19}"),
    ("\\frac{-1 \\pm \\sqrt{13}}{4}", "\\frac{-1-\\sqrt{13}}{4}, \\frac{-1+\\sqrt{13}}{4}"),
    ("\\{1\\pm\\sqrt{5},-2\\}", "\\{-2, 1+\\sqrt 5, 1-\\sqrt 5\\}"),
    ("3 \\mp 1", "4, 2"),
    # repeating decimals: exact fractions
    ("0.\\overline{3}", "\\frac{1}{3}"),
    ("0.1\\overline{6}", "\\frac16"),
    ("0.08\\overline{3}", "\\frac{1}{12}"),
    ("1.\\overline{09}", "\\frac{12}{11}"),
    ("0.\\overline{142857}", "\\frac{1}{7}"),
    (".\\bar{6}", "\\frac{2}{3}"),
    # factorials and binomials
    ("5!", "120"),
    ("\\frac{10!}{8!}", "90"),
    ("(n+1)!", "(n+1) \\cdot n!"),
    ("\\binom{5}{2}", "10"),
    ("\\dbinom{6}{3}", "20"),
    ("\\tbinom{5}{2}", "10"),
    ("{5 \\choose 2}", "10"),
    ("\\binom{n}{2}", "\\frac{n(n-1)}{2}"),
    # equations: the same one scaled by a non-zero constant (x = 3 is x - 3 = 0)
    ("x - 3 = 0", "x = 3"),
    ("2x = 6", "x = 3"),  # scaled by 2: the same equation (docs/evaluation.md)
    ("3 = x", "x = 3"),
    ("y = 2x + 1", "2y = 4x + 2"),
    ("y = x", "x = y"),
    ("y = 2x + 1", "x = \\frac{y - 1}{2}"),
    ("2x+4y-3=0", "y=-\\frac{1}{2}x+\\frac{3}{4}"),
    ("\\frac{x^2}{4} + \\frac{y^2}{3} = 1", "\\frac{x^2}{16} + \\frac{y^2}{12} = \\frac14"),
    # factorials and binomials in three variables (each took 1-3 s through derivatives of the gamma function)
    ("\\binom{x}{y}+\\binom{x}{z} = \\binom{y}{z}", "2\\binom{x}{y}+2\\binom{x}{z} = 2\\binom{y}{z}"),
    ("\\binom{x}{y} = \\binom{x}{z}", "2\\binom{x}{y} = 2\\binom{x}{z}"),
    ("\\binom{x+y}{z} = x", "\\binom{x+y}{z}\\cdot 5 = 5x"),
    ("x! y! = z!", "2x! y! = 2z!"),
    ("x + y = 1", "\\sqrt{2}x + \\sqrt{2}y = \\sqrt{2}"),  # a factor no small fraction: the pairs of points decide
    ("y = \\pi x", "\\frac{y}{\\pi} = x"),
    # an irrational factor on terms that differ in form: only the values at the test points can tell (_same_ratio)
    ("(x+1)^2 = y", "\\sqrt{2}x^2 + 2\\sqrt{2}x + \\sqrt{2} = \\sqrt{2}y"),
    ("\\binom{y}{z}^{2} + \\sin(x z) = x!", "\\sqrt{3}(\\binom{y}{z}^{2} + \\sin(x z)) - \\sqrt{3}x! = 0"),
    # real odd roots; \log is base 10
    ("\\sqrt[3]{-8}", "-2"),
    ("\\sqrt[5]{-32}", "-2"),
    ("\\sqrt[3]{-2}", "-\\sqrt[3]{2}"),
    ("\\sqrt[4]{16}", "2"),
    ("\\sqrt{2+\\sqrt{2+\\sqrt{2}}}", "2\\cos\\frac{\\pi}{16}"),  # nested MAX_NESTING deep
    ("\\log_2(\\log_2(\\log_2 65536))", "2"),
    ("\\log 100", "2"),
    ("\\log 2 + \\log 5", "1"),
    ("\\ln e^{3}", "3"),
    # scale words are factors, not units
    ("5\\text{ thousand}", "5000"),
    ("2.5\\text{ million}", "2,500,000"),
    ("3\\text{ Millions}", "3 \\cdot 10^6"),
    ("5\\text{ thousand}.", "5000"),  # a full stop after the unit, as scoring.py's number path takes it
    ("5\\text{ thousand dollars}", "5000\\text{ dollars}"),
    ("5\\text{ hundred thousand}", "500,000"),  # every leading scale word is a factor
    ("5\\text{ thousandths}", "0.005"),
    ("5\\text{ dozen}", "60"),  # a dozen is 12 (was a unit: 5)
    # units: the trailing \\text{} / \\mathrm{} words that name units of measure or money (docs/evaluation.md)
    ("2\\mathrm{m}", "2"),
    ("12\\text{ square units}", "12"),
    ("3\\text{ hours}", "3"),
    ("60\\text{ miles per hour}", "60"),
    ("25\\text{ percent}", "25"),  # as 25\\% (a unit before the whitelist too)
    ("25\\text{ percent}", "0.25"),  # its number / 100 too, as 25\\%
    ("4.5\\text{ cm}^2", "4.5"),
    ("20\\text{ cm}^{2}", "20\\text{ cm}^2"),
    ("2\\mathrm{x}", "2x"),  # an upright x is still x
    ("3\\mathrm{i}", "3i"),
    # mixed numbers (as math-verify reads them), when nothing multiplies them
    ("2\\frac{1}{2}", "\\frac{5}{2}"),
    ("2\\frac{1}{2}", "2.5"),
    ("-3\\frac{1}{4}", "-\\frac{13}{4}"),
    ("6\\frac14", "6.25"),
    ("1\\frac{1}{2} + 2\\frac{1}{3}", "\\frac{23}{6}"),
    ("3 \\cdot 2\\frac{1}{2}", "7.5"),
    ("4\\tfrac{2}{3}\\text{ cups}", "\\frac{14}{3}"),
    # a negative number to a power p/q with q odd is real, as its odd root is
    ("(-8)^{1/3}", "-2"),
    ("(-8)^{\\frac{2}{3}}", "4"),
    ("(-27)^{-1/3}", "-\\frac{1}{3}"),
    ("(-2)^{1/3}", "\\sqrt[3]{-2}"),
    # formatting: \textnormal units, \cfrac, x \in, named lists, "and"
    ("125\\textnormal{ miles}", "125"),
    ("\\cfrac{1}{3}", "1/3"),
    ("x \\in [-2, 7]", "[-2,7]"),
    ("k = 45, n = 2", "45, 2"),
    ("6 \\text{ and } 8", "6, 8"),
    ("f(x) = 2x + 1", "2x+1"),  # a named function, as x = before a value
    ("f^{-1}(x) = \\frac{x-3}{2}", "\\frac{x-3}{2}"),
    ("\\mathbb{R}", "(-\\infty, \\infty)"),
    ("1011_2", "1011_{2}"),  # a number in base 2, as text
    ("x \\leq 3", "x \\le 3"),  # inequalities, as text
    ("x <= 3", "x \\leqslant 3"),
    ("x \\neq 3", "x != 3"),
    ("x ≤ 3", "x \\le 3"),
    ("\\varnothing", "\\left\\{ \\right\\}"),
    ("2π", "2\\pi"),  # Unicode symbols
    ("3×4", "12"),
    ("(x, y) = (1, 2)", "(1, 2)"),  # a named pair
    # vectors and matrices, entry by entry
    ("\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}", "\\begin{pmatrix}-\\frac{1}{3}\\\\ \\frac{2}{3}\\end{pmatrix}"),
    # units inside tuples, sets and lists, and plain unit words (no \text{}): a unit of the whitelist, 2 letters or more
    ("(2\\text{ cm}, 3\\text{ cm})", "(2, 3)"),
    ("\\left(2 \\text{ cm}, 3 \\text{ cm}\\right)", "(2\\text{ cm}, 3\\text{ cm})"),
    ("(2 cm, 3 cm)", "(2, 3)"),
    ("2\\text{ cm}, 3\\text{ cm}", "3, 2"),
    ("\\{2\\mathrm{g}, 5\\mathrm{g}\\}", "\\{5, 2\\}"),
    ("[2\\text{ m}, 5\\text{ m})", "[2, 5)"),
    ("(4\\text{ cm}^2, 9\\text{ cm}^2)", "(4, 9)"),
    ("2 cm", "2"),
    ("3 hours", "3"),
    ("60 miles per hour", "60"),
    ("12 square units", "12"),
    ("5 thousand", "5000"),  # a plain scale word is a factor, as a wrapped one
    ("2\\mathrm{g}", "2\\text{ g}"),  # the same unit written two ways
    ("2\\mathrm{g}", "2 \\, \\mathrm{g}"),
    ("2\\mathrm{kg}", "2 kg"),
    ("2\\mathrm{g}", "2g"),  # the same text once \\mathrm{} is dropped (the plain letter alone is a variable: not 2)
    # an equation in x is no named value, even when it starts "x ="; x = x and 0 = 0 state no relation (refused)
    ("x = 2x + 1", "x = -1"),
    ("x = 2x + 1", "x + 1 = 0"),
    ("0 = 0", "0=0"),  # the same text
    # an equation stating a number (math-verify reads an equation against a bare value as its last side)
    ("m + n = 25", "25"),  # AIME: "find m + n"
    ("a+b+c = \\frac{3}{2}", "1.5"),
    ("3 \\times 4 = 12", "12"),  # a computation that holds states its result
    ("0 = 0", "0"),
    # a multiple-choice letter with its option's value (AMC problems in MATH): the letter or the value
    ("\\textbf{(E)}\\ 12", "12"),
    ("(E) 12", "\\text{(E)}"),
    ("\\text{(C) } \\frac{1}{2}", "0.5"),
    ("\\textbf{(B) } 2\\sqrt{2}", "\\textbf{(B)}\\ \\sqrt{8}"),
    ("(D) 7", "D"),
    ("\\begin{bmatrix}1&\\sqrt{8}\\\\3&4\\\\\\end{bmatrix}", "\\begin{pmatrix} 1 & 2\\sqrt2 \\\\ 3 & 4 \\end{pmatrix}"),
]

DIFFERENT = [  # (answer, reference): not the same value
    ("1/2", "2"),
    ("\\frac{1}{2}", "2"),
    ("10", "100"),  # Qwen2.5-Math's grader takes 100 for 1 (a reference read as a percentage)
    ("1000", "10\\%"),
    ("\\sqrt{2}", "1.414"),  # a 1e-4 tolerance takes it
    ("1.4142", "\\sqrt{2}"),
    ("0.333", "\\frac{1}{3}"),
    ("\\pi", "3.14159"),
    ("25", "0.25"),  # neither a percentage
    ("2\\frac{1}{2}", "1"),  # a mixed number is no product
    ("2\\frac{1}{2}x", "x"),  # 2 times x/2, or 5x/2? refused, not guessed
    ("2\\frac{1}{2}x", "\\frac{5}{2}x"),
    ("2\\frac{1}{2}\\pi", "\\pi"),
    ("2\\frac{3}{2}", "\\frac{7}{2}"),  # no proper fraction: no mixed number
    ("2\\frac{3}{2}", "3"),
    ("2\\frac{1}{2}^2", "\\frac{25}{4}"),  # 2 (1/2)^2 as typeset
    ("2^10", "1024"),  # LaTeX typesets 2^1 0
    ("(1, 2)", "(2, 1)"),  # a tuple is ordered
    ("[0, 1)", "[0, 1]"),  # an open end is not a closed one
    ("(1, 2)", "[1, 2]"),
    ("1, 2", "1, 2, 3"),
    ("x^2 + 1", "x^2 - 1"),
    ("x + 1", "y + 1"),
    ("(x+1)^2", "x^2+1"),
    ("2\\sqrt{2}", "\\sqrt{2}"),
    ("5\\text{ cm}", "5\\text{ m}"),  # two different units
    ("3i", "3"),
    ("\\frac{\\pi}{2}", "\\frac{\\pi}{3}"),
    ("y = 2x + 1", "y = 2x - 1"),
    ("x + y = 1", "x - y = 1"),
    ("x = 3", "y = 3"),  # "x =" is formatting against a bare value, not against another variable (asymptotes)
    ("y=-2", "x=-2"),
    ("y = 2t + 1", "x = 2t + 1"),
    ("12, 345", "12,345"),  # a list of two numbers is not a number with a thousands comma (as text neither)
    ("\\text{east}", "\\text{seat}"),  # words are no products of variables: anagrams differ
    ("\\text{no}", "\\text{on}"),
    ("odd", "dod"),
    # a tolerance hidden in the identity test: a tiny value is no 0, a memorised decimal is no pi
    ("10^{-50}\\pi", "0"),
    ("e^{-200}", "0"),
    ("3.14159265358979323846264338327950288419716939937510", "\\pi"),
    ("10^{50}\\pi + \\sqrt{2}", "10^{50}\\pi"),
    ("x + 10^{-60}\\sqrt{2}", "x"),
    # next to every rule above, what it must not take
    ("\\pm 2", "2"),  # one of the two values is not the answer
    ("\\pm 2", "-2"),
    ("\\pm 2", "2, 2"),
    ("x = \\pm 2", "y = 2, y = -2"),
    ("1 \\pm \\sqrt{19}", "1 + \\sqrt{19}"),
    ("3 \\mp 1", "3 \\pm 2"),
    ("0.\\overline{3}", "0.333"),
    ("0.\\overline{3}", "0.3"),
    ("0.1\\overline{6}", "0.\\overline{16}"),
    ("5!", "5"),
    ("5!", "24"),
    ("\\binom{5}{2}", "5"),
    ("\\binom{6}{2}", "\\binom{6}{3}"),
    ("\\binom{n}{2}", "\\frac{n(n+1)}{2}"),
    ("x - 3 = 0", "3"),  # an equation is no value: the reply did not solve it
    ("x - 3 = 0", "y = 3"),
    ("2x = 6", "y = 3"),
    ("(x - 3)^2 = 0", "x = 3"),  # the same solution set, but not the same equation: equations are not solved
    ("x^2 = 9", "x = 3"),
    ("x! y! = z!", "x! y! = 2z!"),
    ("\\binom{x}{y} = z", "\\binom{x}{z} = y"),
    ("x + y = 1", "x + y + 10^{-60}z = 1"),  # a tiny term is no constant factor
    ("x + y = 1", "x + y + e^{-100}z = 1"),
    ("(x+1)^2 = y", "\\sqrt{2}x^2 + 2\\sqrt{2}x + \\sqrt{2} = \\sqrt{3}y"),  # two factors: no one constant
    ("\\binom{y}{z}^{2} + \\sin(x z) = x!", "\\sqrt{3}(\\binom{y}{z}^{2} + \\sin(x y)) - \\sqrt{3}x! = 0"),
    # both sides vanish at two of the three points (x > 0 there): every pair of points compared 0 with 0
    ("|x| = x", "y|x| = xy"),
    ("|x| = x", "(y+1)(|x| - x) = 0"),
    ("\\sqrt{x^2} = x", "y\\sqrt{x^2} = xy"),
    ("|x| = 3", "x = 3"),
    ("y = 2x + 1", "x = \\frac{y + 1}{2}"),
    ("\\frac{x^2}{4} + \\frac{y^2}{3} = 1", "\\frac{x^2}{16} + \\frac{y^2}{12} = 1"),
    ("\\sqrt[3]{-8}", "2"),
    ("\\sqrt[4]{16}", "-2"),
    ("\\sqrt[4]{16}", "4"),
    ("\\log 100", "\\ln 100"),
    ("\\log 100", "4.605"),
    ("5\\text{ thousand}", "5"),  # was taken as 5 with a unit
    ("5\\text{ thousands}", "5"),
    ("5\\text{ thousand}.", "5"),
    ("5\\text{ million}", "5000"),
    ("5\\text{ thousand dollars}", "5\\text{ dollars}"),
    ("5\\text{ hundred thousand}", "500"),  # was 500 of a unit "thousand"
    ("5\\text{ thousandths}", "5"),  # was 5 of a unit "thousandths"
    ("5\\text{ dozen}", "5"),  # was 5 of a unit "dozen"
    ("5\\text{ dozen}", "12"),
    ("5\\text{ thousands place}", "5000"),  # a place value: the digit 5 or 5000? refused
    ("5\\text{ thousands place}", "5"),
    ("3\\text{ tens}", "3"),
    ("2\\mathrm{x}", "2"),  # a variable is no unit (was stripped as one)
    ("2\\text{x}", "2"),
    ("2\\text{ x}", "2"),
    ("7\\mathrm{n}", "7"),
    ("3\\mathrm{i}", "3"),
    ("2\\text{ halves}", "2"),
    ("4\\text{ cm}^2", "4\\text{ cm}"),  # an area is not a length
    ("25\\text{ percent}", "2500\\%"),  # 25 percent is 25\\% (was 25 of a unit: 2500\\% / 100)
    ("(-8)^{1/3}", "1 + \\sqrt{3}i"),  # the real root, not sympy's principal one
    ("(-8)^{1/3}", "2"),
    ("x \\in [-2, 7]", "[-2, 7)"),
    ("6 \\text{ and } 8", "6"),
    ("f(x) = 2x + 1", "2x - 1"),
    ("f(3) = 5", "3"),
    ("x(x+1) = 0", "0"),  # an equation, not a named value
    ("\\mathbb{R}", "(0, \\infty)"),
    ("1011_2", "1011_{3}"),
    ("x \\geq 3", "x \\le 3"),
    ("x < 3", "x > 3"),
    ("\\emptyset", "\\{0\\}"),
    ("2π", "\\pi"),
    ("(x, y) = (1, 2)", "(2, 1)"),
    ("(y, x) = (1, 2)", "(1, 2)"),  # x = 2, y = 1: its names are not dropped out of order
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1 & 3\\\\ 2 & 4\\end{pmatrix}"),  # transposed
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\end{pmatrix}"),  # a column is no row
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1, 2)"),
    # units inside tuples and lists are compared as the unit of a single value is
    ("(2\\text{ cm}, 3\\text{ cm})", "(2\\text{ m}, 3\\text{ m})"),
    ("(2\\text{ cm}, 3\\text{ cm})", "(3, 2)"),
    ("(2 cm, 3 cm)", "(2 km, 3 km)"),
    ("(2\\mathrm{x}, 3)", "(2, 3)"),  # a letter that names no unit is still a variable
    ("\\{2\\text{ cm}, 3\\text{ cm}\\}", "\\{2, 4\\}"),
    ("(4\\text{ cm}^2, 9\\text{ cm}^2)", "(4\\text{ cm}, 9\\text{ cm})"),
    ("2 cm", "2 m"),
    ("2 cm", "3"),
    ("2g", "2"),  # a plain letter is a variable (2 grams only as 2\\mathrm{g} or 2\\text{ g})
    ("2 ab", "2"),  # words that name no unit are no unit
    ("2\\text{ g}", "2\\text{ kg}"),
    # identities (0 = 0, x = x) and false statements in numbers are no relation: two of them are not one answer
    ("0 = 0", "x = x"),
    ("x = x", "y = y"),
    ("0 = 0", "1 = 1"),
    ("x + 1 = 1 + x", "0 = 0"),
    ("x(x+1) = x^2 + x", "y = y"),
    ("0 = 1", "0 = 2"),
    ("x = x", "x"),  # not the value x named x
    ("x = 2x + 1", "2x + 1"),  # an equation in x, not the value 2x + 1
    ("y = 3y", "3y"),
    ("x = 2x + 1", "x = 1"),
    ("m + n = 25", "26"),
    ("m + n = 25", "m"),
    ("m + n = 25", "25\\%"),
    ("3 \\times 4 = 13", "13"),  # a false statement states nothing
    ("3 \\times 4 = 13", "12"),
    ("x - 5 = 0", "0"),  # an equation with 0 on one side is to be solved: no value
    ("a + b = 2c", "2c"),  # a side in variables is no value
    ("(E) 12", "13"),
    ("(E) 12", "(D)"),
    ("(E) 12", "(D) 12"),  # the letter is the answer chosen: another option with the same value is not it
    ("\\textbf{(E)}\\ 12", "D"),
    ("(E) 12", "(E) 13"),
    ("(A) \\text{ or } (B)", "A"),  # two options named: a hedge, not the first option with a value
    ("\\textbf{(A)}\\ 2 \\text{ and } \\textbf{(C)}\\ 4", "2"),
    ("(A), (C)", "A"),
    ("(C)(D)", "C"),
    ("\\begin{vmatrix} 1 & 2 \\\\ 3 & 4 \\end{vmatrix}", "-2"),  # a determinant is not translated
]


@pytest.mark.parametrize("answer, reference", SAME)
def test_forms_of_the_same_value_score(answer: str, reference: str) -> None:
    assert SCORERS["boxed"](f"So the answer is $\\boxed{{{answer}}}$.", reference)[1]
    assert SCORERS["boxed"](f"\\boxed{{{reference}}}", answer)[1]  # either way round


@pytest.mark.parametrize("answer, reference", DIFFERENT)
def test_different_values_do_not_score(answer: str, reference: str) -> None:
    assert not SCORERS["boxed"](f"\\boxed{{{answer}}}", reference)[1]
    assert not SCORERS["boxed"](f"\\boxed{{{reference}}}", answer)[1]


ONE_WAY = [  # (answer, reference, right): an equation states its right side against a bare value when it is the
    # model's (math-verify: "m + n = 25", "a^2 + b^2 = 25" answer "find ..."), but a reference equation does so only
    # when its left side names the quantity, variables alone (math-verify's assignment): the reference circle
    # x^2 + y^2 = 25 is not the answer 25, the line 2x + 3y = 12 not 12
    ("a^2 + b^2 = 25", "25", True),
    ("25", "x^2 + y^2 = 25", False),
    ("12", "2x + 3y = 12", False),
    ("1", "\\frac{x^2}{4} + \\frac{y^2}{9} = 1", False),
    ("5", "k + 1 = 5", False),  # a number in the left side: no assignment
    ("5", "k - 1 = 5", False),
    ("3", "m - n = 3", True),
    ("25", "m + n = 25", True),
    ("\\frac{7}{2}", "\\frac{m}{n} - k = 3.5", True),
]


@pytest.mark.parametrize("answer, reference, right", ONE_WAY)
def test_an_equation_states_its_number_as_the_answer_not_as_the_reference(answer: str, reference: str,
                                                                          right: bool) -> None:
    assert SCORERS["boxed"](f"\\boxed{{{answer}}}", reference)[1] is right


HEDGES = [  # (scorer, reply, reference, the answer it reads, right?)
    ("boxed", "It is \\boxed{5}, or maybe \\boxed{6}.", "6", "5, 6", False),  # one of them right: still a hedge
    ("boxed", "It is \\boxed{5}, or maybe \\boxed{6}.", "5", "5, 6", False),
    ("boxed", "\\boxed{\\frac{1}{2}}; as a decimal, \\boxed{0.5}.", "1/2", "0.5", True),  # the same answer twice
    ("boxed", "\\boxed{2^{10}} = \\boxed{1024}", "1024", "1024", True),
    ("boxed", "\\boxed{1024} then \\boxed{1024}", "1024", "1024", True),
    # the model's number and its equation stating it (either order): one answer, though only the equation states it
    ("boxed", "\\boxed{25}, since \\boxed{a^2 + b^2 = 25}", "25", "a^2 + b^2 = 25", True),
    ("boxed", "\\boxed{a^2 + b^2 = 25}, so \\boxed{25}", "25", "25", True),
    ("boxed", "\\boxed{7} and \\boxed{7", "7", None, False),  # the last box was cut off
    ("boxed", "I must put the answer in \\boxed{}. Done: \\boxed{7}", "7", "7", True),  # an empty box is none
    # a box per solution states the list: it is right against a reference listing exactly those
    ("boxed", "The roots are \\boxed{3} and \\boxed{-5}.", "-5, 3", "3, -5", True),
    ("boxed", "The roots are \\boxed{3} and \\boxed{-5}.", "3", "3, -5", False),
    ("boxed", "The roots are \\boxed{3} and \\boxed{-5}.", "3, -5, 1", "3, -5", False),
    ("boxed", "\\boxed{12} or \\boxed{345}", "12,345", "12, 345", False),  # two boxes are no thousands number
    ("boxed", "So $x = \\boxed{2}$ or $x = \\boxed{-2}$.", "\\pm 2", "2, -2", True),  # a box per sign of \\pm
    ("boxed", "So $x = \\boxed{2}$ or $x = \\boxed{-2}$.", "2", "2, -2", False),
    ("choice", "\\boxed{A} ... on reflection \\boxed{C}", "C", None, False),
    ("choice", "\\boxed{C}, I repeat: \\boxed{(C)}", "C", "C", True),
    ("choice", "\\boxed{A}. Hmm, no: \\boxed{B", "A", None, False),  # the last box was cut off: no answer, as boxed
    ("choice", "Reply with \\boxed{} holding a letter. \\boxed{B}", "B", "B", True),
    ("exact", "\\boxed{Paris} or \\boxed{Lyon}", "Lyon", None, False),
    ("exact", "\\boxed{Paris}, so: \\boxed{ Paris }", "Paris", " Paris ", True),
]


@pytest.mark.parametrize("scorer, reply, reference, answer, right", HEDGES)
def test_two_different_boxed_answers_are_a_hedge_and_score_0(scorer: str, reply: str, reference: str,
                                                            answer: str | None, right: bool) -> None:
    assert SCORERS[scorer](reply, reference) == (answer, right)


def test_boxes_are_read_in_order_with_nesting_and_truncation() -> None:
    assert boxed_answers("\\boxed{\\frac{a}{\\sqrt{b}}} x \\fbox{2} \\boxed 3. \\boxed{4") == \
        ["\\frac{a}{\\sqrt{b}}", "2", "3", None]
    assert boxed_answers("\\boxed{\\boxed{5}}") == ["5"]
    deep = "\\boxed{" * 3000 + "5" + "}" * 3000  # a degenerate loop: raised RecursionError (the eval ended)
    assert boxed_answers(deep) == [deep[7 * (MAX_NESTED_BOXES + 1):-(MAX_NESTED_BOXES + 1)]]
    assert [SCORERS[scorer](deep, "5")[1] for scorer in ("boxed", "choice", "exact")] == [False] * 3
    assert boxed_answers("\\boxed{" * MAX_NESTED_BOXES + "5" + "}" * MAX_NESTED_BOXES) == ["5"]
    assert final_answer("no box. Answer: 12") == "12" and final_answer("\\boxed{1} \\boxed{2}") is None
    boxes = "\\boxed{1} \\boxed{2} \\boxed{1.0} \\boxed{}"
    assert stated_answers(boxes) == ["1", "2", "1.0"]  # as text 1 is not 1.0; each in its last box's form
    assert stated_answers(boxes, SCORERS["boxed"].equal) == ["2", "1.0"]  # as maths it is
    assert stated_answers("\\boxed{1} \\boxed{2}", lambda a, b: True) == ["2"] and stated_answers("none") is None


PATHOLOGICAL = ["9^{9^{9^9}}", "10^{10^{10}}", "2^{2^{100}}", "(\\sqrt{2})^{10^{9}}", "x^{10^{9}}",
                "((10^{100}\\sqrt{2})^{1000})^{1000}", "(1+\\sqrt{2})^{10^{9}}", "\\sin(10^{99999})",
                "9^{9^{9^9}} - 9^{9^{9^9}}", "\\sqrt[7]{3^{6000}+1}",  # the last: 25 s of sympy factoring
                "2^{2^{\\pi \\cdot 10^{9}}}", "e^{e^{e^{9}}}", "x^{e^{e^{9}}}",  # irrational exponents: evalf hung
                "(10^{5})!", "((5!)!)!", "(x^{100})!", "\\binom{10^{100}}{10^{50}}", "\\binom{x^{100}}{2}",
                "\\sqrt[3]{-3^{6000}-1}",
                "\\log(" * 8 + "5" + ")" * 8, "\\ln(" * 12 + "x" + ")" * 12,  # nested: ~30 times slower a level
                "\\sqrt[3]{" * 12 + "x" + "-5}" * 12, "(" * 12 + "x" + ")^{\\pi}" * 12,
                ", ".join(f"{i} \\pm \\sqrt{{2}}" for i in range(MAX_ITEMS // 2 + 1)),  # 34 values
                "\\begin{pmatrix}" + "\\\\".join("&".join("1" * 3) for _ in range(11)) + "\\end{pmatrix}"]  # 33 entries


@pytest.mark.timeout(60)  # before the size bound the first of these never returned
@pytest.mark.parametrize("answer", PATHOLOGICAL)
def test_a_pathological_answer_is_refused_without_computing_it(answer: str) -> None:
    """sympy evaluates a rational to a rational power exactly as it builds it; the translation refuses a power of
    over MAX_DIGITS digits, and a root of a number of over MAX_ROOT_DIGITS, first, so the answer is compared as text:
    it scores 0 and returns at once."""
    assert parse_answer(answer) is None
    assert not SCORERS["boxed"](f"\\boxed{{{answer}}}", "1")[1]
    assert not SCORERS["boxed"](f"\\boxed{{{answer}}} \\boxed{{{answer}1}}", "1")[1]  # the hedge check too
    assert SCORERS["boxed"](f"\\boxed{{{answer}}}", answer)[1]  # the same text is still the same answer


@pytest.mark.timeout(60)  # before the bound on a unit's words: 27 s for 68k characters, quadratic (~2 min here)
def test_a_box_of_looping_words_is_scored_at_once() -> None:
    """A degenerate reply boxes a phrase repeated to its token budget, then a number: the search for a trailing unit
    in plain words (``2 cm``) tried every word as the start of one running to the end (a unit is a few words)."""
    looping = "\\boxed{" + "so the answer is " * 8000 + "5}"  # 136k characters, a 32k-token reply
    assert SCORERS["boxed"](looping, "5") == (looping[7:-1], False)
    assert SCORERS["boxed"]("\\boxed{5 hundred thousand square feet per hour}", "500000")[1]  # the longest we read
    spaced = "\\boxed{\\textbf{(E)}\\ 12" + " " * 5000 + ".}"  # an option's value, then a run of spaces (~2 min before)
    assert SCORERS["boxed"](spaced, "12")[1] and SCORERS["boxed"](spaced, "E")[1]


@pytest.mark.timeout(60)  # before the bound these 3000 boxes took ~4 h: every pair compared symbolically
def test_a_reply_looping_through_thousands_of_boxes_is_scored_at_once() -> None:
    """A degenerate reply (an RL model's loop to its token budget) boxes thousands of different answers: only up to
    MAX_ANSWERS different texts are compared with each other; past them the reply is a hedge as written."""
    looping = " ".join(f"\\boxed{{{i}\\sqrt{{2}}}}" for i in range(3000))
    assert SCORERS["boxed"](looping, "\\sqrt{2}")[1] is False
    assert len(stated_answers(looping, SCORERS["boxed"].equal)) == 3000
    few = " ".join(f"\\boxed{{\\sqrt{{{4 * i * i}}}}} \\boxed{{{2 * i}}}" for i in range(1, MAX_ANSWERS // 2 + 1))
    assert stated_answers(few, SCORERS["boxed"].equal) == [str(2 * i) for i in range(1, MAX_ANSWERS // 2 + 1)]
    long_list = ", ".join(f"{i}\\sqrt{{2}}" for i in range(MAX_ITEMS + 1))
    assert parse_answer(long_list) is None and SCORERS["boxed"](f"\\boxed{{{long_list}}}", long_list)[1]


def test_what_the_translation_refuses() -> None:
    for text in ("2\\frac{1}{2}x", "2\\frac{1}{2}\\pi", "2\\frac{1}{2}^2", "2\\frac{3}{2}", "x 2\\frac{1}{2}",
                 "2.5\\frac{1}{2}", "2\\frac{x}{2}", "5\\text{ thousands place}", "2\\text{ halves}",
                 "1 2", "x > 3", "\\begin{vmatrix}1\\end{vmatrix}", "a = b = c", "1/0", "0^{-1}",
                 "x" * (MAX_CHARS + 1), "5!!", "x != 3", "(-1)!", "(\\frac{1}{2})!", f"{MAX_FACTORIAL + 1}!",
                 f"\\binom{{{MAX_FACTORIAL + 1}}}{{2}}", "(\\pm 1, 2)", "1, 2\\text{ million}",
                 "x = x", "0 = 1", "x(x+1) = x^2 + x", "(1, 2\\text{ million})"):
        assert parse_answer(text) is None, text
    assert parse_answer("5\\text{ thousand}").value == 5000 and parse_answer("5\\text{ thousand}").unit == ""
    assert expression("2\\sqrt{2}") == expression("\\sqrt{8}")
    assert str(expression("\\frac12 + x_1 \\cdot \\alpha")) == "alpha*x_1 + 1/2"


def _repeating_decimal(p: int, q: int) -> str:
    """p/q (0 < p/q) written by long division, its period in \\overline{} (an independent reading of the notation)."""
    whole, remainder = divmod(p, q)
    digits, seen = "", {}
    while remainder and remainder not in seen:
        seen[remainder] = len(digits)
        digit, remainder = divmod(remainder * 10, q)
        digits += str(digit)
    if not remainder:
        return f"{whole}.{digits or 0}"
    start = seen[remainder]
    return f"{whole}.{digits[:start]}\\overline{{{digits[start:]}}}"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(2, 60), st.integers(0, 12))
def test_the_notations_read_as_their_values(p: int, q: int, n: int) -> None:
    """Repeating decimals, factorials, binomials and real odd roots against values computed apart from them; the
    next value is never taken for them."""
    decimal = _repeating_decimal(p, q)
    assert SCORERS["boxed"](f"\\boxed{{{decimal}}}", f"\\frac{{{p}}}{{{q}}}")[1], decimal
    assert not SCORERS["boxed"](f"\\boxed{{{decimal}}}", f"\\frac{{{p + 1}}}{{{q}}}")[1], decimal
    k = p % (n + 1)
    for notation, value in ((f"{n}!", math.factorial(n)), (f"\\binom{{{n}}}{{{k}}}", math.comb(n, k)),
                            (f"{{{n} \\choose {k}}}", math.comb(n, k)), (f"\\sqrt[3]{{-{p ** 3}}}", -p),
                            (f"\\pm {p}", f"{-p}, {p}")):
        assert SCORERS["boxed"](f"\\boxed{{{notation}}}", str(value))[1], notation
        wrong = value + 1 if isinstance(value, int) else f"{-p}, {p + 1}"
        assert not SCORERS["boxed"](f"\\boxed{{{notation}}}", str(wrong))[1], notation


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-9, 9).filter(bool), min_size=3, max_size=3), st.integers(-20, 20),
       st.sampled_from(["2", "-\\frac{3}{7}", "\\sqrt{3}", "\\pi", "e"]), st.booleans())
def test_an_equation_scaled_by_a_constant_is_the_same_one(coefficients: list[int], constant: int, scale: str,
                                                         grouped: bool) -> None:
    """``a x + b y + c z = d`` against itself times a constant, term by term (``_term_factor`` decides) or grouped
    (``k(a x + b y + c z) - k d = 0``: only the values at the test points can), and against itself with ``d + 1``."""
    a, b, c = coefficients
    lhs = f"{a}x + {b}y + {c}z".replace("+ -", "- ")
    if grouped:
        scaled, wrong = f"{scale}({lhs}) - {scale}({constant}) = 0", f"{scale}({lhs}) - {scale}({constant + 1}) = 0"
    else:
        terms = f"{a} \\cdot {scale} x + {b} \\cdot {scale} y + {c} \\cdot {scale} z".replace("+ -", "- ")
        scaled, wrong = f"{terms} = {constant} \\cdot {scale}", f"{terms} = {constant + 1} \\cdot {scale}"
    assert SCORERS["boxed"](f"\\boxed{{{lhs} = {constant}}}", scaled)[1], scaled
    assert not SCORERS["boxed"](f"\\boxed{{{lhs} = {constant}}}", wrong)[1], wrong
