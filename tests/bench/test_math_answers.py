"""Answer extraction and grading of the math sets against hand-checked cases: model output -> the answer the
reference harness extracts -> right or wrong (each row worked out by hand from the rules of Qwen2.5-Math's
``extract_answer``/``math_equal``, the MATH reference's ``strip_string`` and lm-eval's gsm8k filters)."""

import time

import pytest

from restkv.bench.reasoning.answers import extract_gsm8k, extract_math, is_correct, last_boxed
from restkv.bench.reasoning.latex import math_equal, normalize

# (model output, reference, the extracted answer, right?)
MATH = [
    (r"Adding gives $\frac{6}{8} + \frac{1}{8}$, so the answer is $\boxed{\frac{7}{8}}$.", r"\frac{7}{8}",
     r"\frac{7}{8}", True),
    (r"So the sum is $\boxed{\dfrac{7}{8}}$.", r"\frac{7}{8}", r"\dfrac{7}{8}", True),  # \dfrac
    (r"The sum is \boxed{0.875}", r"\frac{7}{8}", "0.875", True),  # the same number as a decimal
    (r"\boxed{7/8}", r"\frac78", "7/8", True),  # a/b and \frac78 both read \frac{7}{8}
    (r"\boxed{\frac{7}{9}}", r"\frac{7}{8}", r"\frac{7}{9}", False),
    (r"First \boxed{12}. Wait, that is wrong: \boxed{15}.", "15", "15", True),  # the last box counts
    (r"First \boxed{12}. Wait, that is wrong: \boxed{15}.", "12", "15", False),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", r"\frac{\sqrt{3}}{2}", True),  # nested braces, \sqrt3
    (r"The length is $\boxed{10\text{ inches}}$.", "10", r"10\text{ inches}", True),  # a unit in \text
    (r"\boxed{45 degrees}", "45", "45 degrees", True),  # a unit word
    (r"\boxed{45^\circ}", "45", r"45^\circ", True),
    (r"\boxed{1,000,000}", "1000000", "1,000,000", True),  # thousands separators
    (r"\boxed{1,2}", "12", "1,2", False),  # a list, not twelve
    (r"\boxed{-3}", "-3", "-3", True),  # negative numbers
    (r"\boxed{3}", "-3", "3", False),
    (r"\boxed{-\frac{1}{2}}", "-0.5", r"-\frac{1}{2}", True),
    (r"It costs \boxed{\$18.90}", "18.90", r"\$18.90", True),  # dollars
    (r"\boxed{25\%}", "25", r"25\%", True),  # percent
    (r"\boxed{(3, 2)}", "(3,2)", "(3, 2)", True),  # ordered pairs, in order
    (r"\boxed{(2, 3)}", "(3,2)", "(2, 3)", False),
    (r"\boxed{[1, \infty)}", r"[1,\infty)", r"[1, \infty)", True),  # intervals, brackets count
    (r"\boxed{(1, \infty)}", r"[1,\infty)", r"(1, \infty)", False),
    (r"\boxed{x = 5}", "5", "x = 5", True),  # a short left-hand side goes
    (r"\boxed{\text{(C)}}", r"\text{(C)}", r"\text{(C)}", True),  # a choice
    (r"\boxed{C}", r"\text{(C)}", "C", True),
    (r"\boxed{3\sqrt{2}}", r"\sqrt{18}", r"3\sqrt{2}", True),  # equal after simplification
    (r"\boxed{2\pi}", r"2 \pi", r"2\pi", True),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", "x^2+2x+1", True),
    (r"\boxed{x^2+2x}", "(x+1)^2", "x^2+2x", False),
    ("Counting them, the answer is 42.\nDone.", "42", "42", True),  # no box: after "the answer is"
    (r"The final answer is $\frac{1}{2}$. I hope it is correct.", "0.5", r"\frac{1}{2}", True),  # Minerva's
    ("We get 12 apples and then 15 pears", "15", "15", True),  # nothing else: the last number
    ("I cannot solve this.", "7", None, False),
    (r"so the answer is \boxed{12", "12", "12", True),  # a box cut short by the generation length
    (r"\boxed{024}", "24", "024", True),  # AIME: an integer written with zeros
    (r"\boxed{391}", 391, "391", True),  # an integer reference
    (r"\fbox{7}", "7", "7", True),
    (r"so $\boxed 5$.", "5", "5", True),
    (r"\boxed{}", "5", None, False),
]

GSM8K = [  # (model output, reference after "#### ", extracted, right?)
    ("She sells 16 - 3 - 4 = 9 eggs for $2 each.\n#### 18", "18", "18", True),  # the data's own format
    (r"So she makes \boxed{18} dollars a day.", "18", "18", True),
    ("She makes 9 * 2 = $18 every day.", "18", "$18", True),  # the last number, $ ignored
    ("It pays 2,500 dollars.", "2,500", "2,500", True),  # commas ignored on both sides
    ("It pays 2,500 dollars.", "2500", "2,500", True),
    ("The answer is 90.", "90", "90.", True),  # a final period ignored
    (r"\boxed{18.00}", "18", "18.00", False),  # exact match: lm-eval counts 18.00 wrong too
    ("The temperature changes by -5 degrees.", "-5", "-5", True),
    ("#### 7\nCheck: 3 + 4 = 7, or was it 8?", "7", "7", True),  # "#### N" before the last number
    ("#### 1,080", "1080", "1,080", True),
    ("I do not know.", "5", "[invalid]", False),
]


@pytest.mark.parametrize("output, reference, extracted, right", MATH)
def test_math_answers_are_extracted_and_graded_as_by_hand(output, reference, extracted, right):
    assert extract_math(output) == extracted
    assert is_correct("math500", output, reference) is right
    assert is_correct("aime25", output, reference) is right


@pytest.mark.parametrize("output, reference, extracted, right", GSM8K)
def test_gsm8k_answers_are_extracted_and_graded_as_lm_eval(output, reference, extracted, right):
    assert extract_gsm8k(output) == extracted
    assert is_correct("gsm8k", output, reference) is right


def test_normalisation_of_the_math_reference_code():
    assert normalize(r"\left( 3, \frac12 \right)") == r"(3,\frac{1}{2})"
    assert normalize(r"\dfrac{3}{4}") == normalize(r"\tfrac34") == r"\frac{3}{4}"
    assert normalize(r"k = \sqrt2") == r"\sqrt{2}"
    assert normalize(".5") == "0.5" and normalize("2.000") == "2"
    assert normalize(r"\$5\text{ dollars}") == "5"
    assert normalize(r"\begin{bmatrix} 1 \\ 2 \end{bmatrix}") == normalize(r"\begin{pmatrix}1\\2\end{pmatrix}")


def test_boxes_are_matched_by_their_braces():
    assert last_boxed(r"a \boxed{\frac{1}{\sqrt{2}}} b") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed("no box") is None


def test_answers_are_never_run_as_code_and_huge_powers_are_not_computed():
    start = time.time()
    assert not math_equal("__import__('os').system('echo hi')", "0")
    assert not math_equal("9^9^9", "1")
    assert not math_equal(r"9^{9^{9}}", "1")
    assert not math_equal(r"2^{(9^9)}", "1")
    assert math_equal(r"2^{10}", "1024")
    assert time.time() - start < 30
