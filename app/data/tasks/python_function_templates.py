"""The builtin:python_functions templates as a table (FUNCTION_TEMPLATES).

Each entry is a family of small function-writing problems: the function's name and arguments, what it must do
(a format string over the template's parameters), and trustbatch's reference solution (Python source, a format
string over the same parameters). One problem is one template with one choice of parameters, e.g. `times_k`
with k = 7: "Write a Python function `times_7(x)` that returns x multiplied by 7". The generator
(python_functions.py) draws the test inputs from the argument kinds named in `args` (ARG_KINDS there) and
computes every expected value by running the reference solution.

Parameters work like the word-problem table's word slots: a key naming several slots ("op sym") takes tuples
unpacked over them, so one template can say "greater" in its text and ">" in its solution.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Category = Literal["arithmetic", "strings", "lists", "loops"]


@dataclass(frozen=True)
class FunctionTemplate:
    """A family of function-writing problems; every combination of `params` that `valid` accepts is one problem."""

    name: str
    """The template's name (a problem's key starts with it)."""
    category: Category
    function: str
    """The function's name, a format string over the parameters (e.g. "times_{k}")."""
    args: str
    """The arguments as `name:kind` separated by spaces, e.g. "xs:int_list x:digit"; kinds: ARG_KINDS of
    python_functions.py."""
    request: str
    """What the function must do, completing "Write a Python function `f(x)` that ...": a format string."""
    solution: str
    """The reference body (indented by four spaces), a format string; the generator adds the `def` line."""
    params: dict[str, tuple] = field(default_factory=dict)
    """Free parameters: slot name(s) -> values (tuples unpacked over several space-separated slots)."""
    valid: Callable[[dict[str, Any]], bool] = lambda p: True

    @property
    def arg_names(self) -> list[str]:
        return [a.split(":")[0] for a in self.args.split()]

    @property
    def arg_kinds(self) -> list[str]:
        return [a.split(":")[1] for a in self.args.split()]

    def problems(self) -> list[dict[str, Any]]:
        """Every parameter assignment of this template, in a fixed order (slot name -> value)."""
        out = []
        for values in itertools.product(*self.params.values()):
            slots: dict[str, Any] = {}
            for key, value in zip(self.params, values, strict=True):
                names = key.split()
                slots.update(zip(names, value, strict=True) if len(names) > 1 else {names[0]: value})
            if self.valid(slots):
                out.append(slots)
        return out

    def source(self, slots: dict[str, Any]) -> str:
        """The reference solution of one problem, a complete function definition."""
        return f"def {self.function.format(**slots)}({', '.join(self.arg_names)}):\n{self.solution.format(**slots)}\n"


_LOWER = tuple(string.ascii_lowercase)
_WORDS = ("sun", "tree", "blue", "river", "stone", "cat", "moon", "red", "cloud", "apple",
          "bird", "green", "lamp", "wind", "fox", "sea", "star", "rain", "leaf", "fire")  # fmt: skip
_CMP = (("greater", ">"), ("less", "<"))


def _table(*templates: FunctionTemplate) -> dict[str, FunctionTemplate]:
    table = {t.name: t for t in templates}
    if len(table) != len(templates):
        raise ValueError("FUNCTION_TEMPLATES: two templates share a name")
    return table


FUNCTION_TEMPLATES: dict[str, FunctionTemplate] = _table(
    # ---------------------------------------------------------------------------- arithmetic on arguments
    FunctionTemplate("add_k", "arithmetic", "add_{k}", "x:int", "returns x plus {k}",
                     "    return x + {k}", {"k": tuple(range(1, 101))}),
    FunctionTemplate("subtract_k", "arithmetic", "subtract_{k}", "x:int", "returns x minus {k}",
                     "    return x - {k}", {"k": tuple(range(1, 101))}),
    FunctionTemplate("times_k", "arithmetic", "times_{k}", "x:int", "returns x multiplied by {k}",
                     "    return x * {k}", {"k": tuple(range(2, 51))}),
    FunctionTemplate("linear", "arithmetic", "line_{a}_{b}", "x:int", "returns {a} times x plus {b}",
                     "    return {a} * x + {b}", {"a": tuple(range(2, 13)), "b": tuple(range(1, 13))}),
    FunctionTemplate("sum_times_k", "arithmetic", "sum_times_{k}", "a:int b:int",
                     "returns the sum of a and b, multiplied by {k}", "    return (a + b) * {k}",
                     {"k": tuple(range(2, 13))}),
    FunctionTemplate("weighted_sum", "arithmetic", "weighted_{p}_{q}", "a:int b:int",
                     "returns {p} times a plus {q} times b", "    return {p} * a + {q} * b",
                     {"p": tuple(range(1, 8)), "q": tuple(range(1, 8))}, lambda s: s["p"] != s["q"]),
    FunctionTemplate("remainder", "arithmetic", "mod_{k}", "x:nat",
                     "returns the remainder when x is divided by {k}", "    return x % {k}",
                     {"k": tuple(range(2, 31))}),
    FunctionTemplate("int_divide", "arithmetic", "divide_by_{k}", "x:nat",
                     "returns x divided by {k}, rounded down to a whole number", "    return x // {k}",
                     {"k": tuple(range(2, 31))}),
    FunctionTemplate("power", "arithmetic", "power_{k}", "x:small_int", "returns x to the power of {k}",
                     "    return x ** {k}", {"k": (2, 3, 4, 5)}),
    FunctionTemplate("distance", "arithmetic", "distance_to_{tag}", "x:int",
                     "returns the absolute difference between x and {k}", "    return abs(x - {k})",
                     {"k tag": tuple((k, f"minus_{-k}" if k < 0 else str(k)) for k in range(-30, 31))}),
    FunctionTemplate("clamp", "arithmetic", "clamp_{tag}_{hi}", "x:int",
                     "returns x limited to the range from {lo} to {hi}: {lo} if x is less than {lo}, {hi} if x is "
                     "greater than {hi}, otherwise x", "    return max({lo}, min({hi}, x))",
                     {"lo tag": tuple((k, f"minus_{-k}" if k < 0 else str(k)) for k in range(-20, 21, 5)),
                      "hi": tuple(range(0, 41, 5))}, lambda s: s["hi"] - s["lo"] >= 5),
    FunctionTemplate("is_multiple", "arithmetic", "is_multiple_of_{k}", "x:int",
                     "returns True if x is divisible by {k}, otherwise False", "    return x % {k} == 0",
                     {"k": tuple(range(2, 31))}),
    FunctionTemplate("between", "arithmetic", "in_range_{lo}_{hi}", "x:int",
                     "returns True if x is between {lo} and {hi} (both included), otherwise False",
                     "    return {lo} <= x <= {hi}",
                     {"lo": tuple(range(0, 41, 5)), "hi": tuple(range(5, 51, 5))}, lambda s: s["hi"] > s["lo"]),
    FunctionTemplate("digit_sum", "arithmetic", "digit_sum", "x:nat",
                     "returns the sum of the decimal digits of x (x is never negative)",
                     "    return sum(int(d) for d in str(x))"),
    FunctionTemplate("count_digits", "arithmetic", "count_digits", "x:nat",
                     "returns how many decimal digits x has (x is never negative)", "    return len(str(x))"),
    FunctionTemplate("max_of_three", "arithmetic", "max_of_three", "a:int b:int c:int",
                     "returns the largest of a, b and c", "    return max(a, b, c)"),
    # ---------------------------------------------------------------------------------------------- strings
    FunctionTemplate("repeat_text", "strings", "repeat_{k}", "s:word",
                     "returns s repeated {k} times, with nothing in between", "    return s * {k}",
                     {"k": tuple(range(2, 10))}),
    FunctionTemplate("count_letter", "strings", "count_{c}", "s:letters_c",
                     "returns how many times the letter '{c}' appears in s", "    return s.count('{c}')",
                     {"c": _LOWER}),
    FunctionTemplate("starts_with", "strings", "starts_with_{c}", "s:letters_c",
                     "returns True if s starts with the letter '{c}', otherwise False",
                     "    return s.startswith('{c}')", {"c": _LOWER}),
    FunctionTemplate("ends_with", "strings", "ends_with_{c}", "s:letters_c",
                     "returns True if s ends with the letter '{c}', otherwise False", "    return s.endswith('{c}')",
                     {"c": _LOWER}),
    FunctionTemplate("replace_letter", "strings", "replace_{c}_with_{d}", "s:letters_c",
                     "returns s with every '{c}' replaced by '{d}'", "    return s.replace('{c}', '{d}')",
                     {"c": tuple("aeiou"), "d": tuple("xyzq")}),
    FunctionTemplate("remove_letter", "strings", "remove_{c}", "s:letters_c",
                     "returns s with every '{c}' removed", "    return s.replace('{c}', '')", {"c": _LOWER}),
    FunctionTemplate("first_chars", "strings", "first_{k}_chars", "s:letters",
                     "returns the first {k} characters of s (all of s if it is shorter)", "    return s[:{k}]",
                     {"k": tuple(range(1, 9))}),
    FunctionTemplate("last_chars", "strings", "last_{k}_chars", "s:letters",
                     "returns the last {k} characters of s (all of s if it is shorter)", "    return s[-{k}:]",
                     {"k": tuple(range(1, 9))}),
    FunctionTemplate("change_case", "strings", "to_{how}", "s:text",
                     "returns s converted to {words}", "    return s.{method}()",
                     {"how words method": (("upper", "upper case", "upper"), ("lower", "lower case", "lower"),
                                           ("swapped", "swapped case (upper case letters become lower case and "
                                            "lower case letters upper case)", "swapcase"))}),
    FunctionTemplate("reverse_string", "strings", "reverse_string", "s:letters", "returns s reversed",
                     "    return s[::-1]"),
    FunctionTemplate("is_palindrome", "strings", "is_palindrome", "s:maybe_palindrome",
                     "returns True if s reads the same forwards and backwards, otherwise False",
                     "    return s == s[::-1]"),
    FunctionTemplate("count_vowels", "strings", "count_vowels", "s:text",
                     "returns how many vowels (a, e, i, o, u, lower or upper case) s contains",
                     "    return sum(1 for ch in s.lower() if ch in 'aeiou')"),
    FunctionTemplate("add_prefix", "strings", "prefix_{w}", "s:word",
                     "returns the text '{w}' followed by s", "    return '{w}' + s", {"w": _WORDS}),
    FunctionTemplate("add_suffix", "strings", "suffix_{w}", "s:word",
                     "returns s followed by the text '{w}'", "    return s + '{w}'", {"w": _WORDS}),
    FunctionTemplate("count_words", "strings", "count_words", "s:text",
                     "returns how many words s contains (words are separated by single spaces)",
                     "    return len(s.split())"),
    FunctionTemplate("longer_than", "strings", "longer_than_{k}", "s:letters",
                     "returns True if s has more than {k} characters, otherwise False", "    return len(s) > {k}",
                     {"k": tuple(range(2, 10))}),
    # ------------------------------------------------------------------------------------------------ lists
    FunctionTemplate("sum_list", "lists", "sum_list", "xs:int_list",
                     "returns the sum of the numbers in the list xs (0 for an empty list)", "    return sum(xs)"),
    FunctionTemplate("list_extreme", "lists", "list_{fn}", "xs:nonempty_int_list",
                     "returns the {word} number in the non-empty list xs", "    return {fn}(xs)",
                     {"fn word": (("max", "largest"), ("min", "smallest"))}),
    FunctionTemplate("count_compare", "lists", "count_{op}_than_{tag}", "xs:int_list",
                     "returns how many numbers in the list xs are {op} than {k}",
                     "    return sum(1 for x in xs if x {sym} {k})",
                     {"op sym": _CMP, "k tag": tuple((k, f"minus_{-k}" if k < 0 else str(k)) for k in range(-10, 11))}),
    FunctionTemplate("filter_compare", "lists", "keep_{op}_than_{tag}", "xs:int_list",
                     "returns a list of the numbers in the list xs that are {op} than {k}, in their original order",
                     "    return [x for x in xs if x {sym} {k}]",
                     {"op sym": _CMP, "k tag": tuple((k, f"minus_{-k}" if k < 0 else str(k)) for k in range(-10, 11))}),
    FunctionTemplate("filter_parity", "lists", "keep_{word}", "xs:int_list",
                     "returns a list of the {word} numbers in the list xs, in their original order",
                     "    return [x for x in xs if x % 2 == {r}]", {"word r": (("even", 0), ("odd", 1))}),
    FunctionTemplate("sum_multiples", "lists", "sum_multiples_of_{k}", "xs:int_list",
                     "returns the sum of the numbers in the list xs that are divisible by {k}",
                     "    return sum(x for x in xs if x % {k} == 0)", {"k": tuple(range(2, 10))}),
    FunctionTemplate("scale_list", "lists", "scale_by_{k}", "xs:int_list",
                     "returns a new list with each number of the list xs multiplied by {k}",
                     "    return [x * {k} for x in xs]", {"k": tuple(range(2, 13))}),
    FunctionTemplate("shift_list", "lists", "shift_by_{tag}", "xs:int_list",
                     "returns a new list with {k} added to each number of the list xs",
                     "    return [x + {k} for x in xs]",
                     {"k tag": tuple((k, f"minus_{-k}" if k < 0 else str(k)) for k in range(-10, 11) if k)}),
    FunctionTemplate("index_of", "lists", "index_of", "xs:digit_list x:digit",
                     "returns the index of the first occurrence of x in the list xs, or -1 if x is not in xs",
                     "    return xs.index(x) if x in xs else -1"),
    FunctionTemplate("contains_k", "lists", "contains_{k}", "xs:digit_list",
                     "returns True if the number {k} is in the list xs, otherwise False", "    return {k} in xs",
                     {"k": tuple(range(10))}),
    FunctionTemplate("count_k", "lists", "count_{k}s", "xs:digit_list",
                     "returns how many times the number {k} appears in the list xs", "    return xs.count({k})",
                     {"k": tuple(range(10))}),
    FunctionTemplate("end_element", "lists", "{word}_element", "xs:nonempty_int_list",
                     "returns the {word} element of the non-empty list xs", "    return xs[{i}]",
                     {"word i": (("first", 0), ("last", -1))}),
    FunctionTemplate("nth_element", "lists", "element_{k}", "xs:long_int_list",
                     "returns the element at index {k} of the list xs (indexes start at 0)", "    return xs[{k}]",
                     {"k": tuple(range(5))}),
    FunctionTemplate("product_list", "lists", "product", "xs:small_int_list",
                     "returns the product of the numbers in the list xs (1 for an empty list)",
                     "    result = 1\n    for x in xs:\n        result *= x\n    return result"),
    # ---------------------------------------------------------------------------- loops and conditionals
    FunctionTemplate("factorial", "loops", "factorial", "n:small_nat", "returns n factorial (1 when n is 0)",
                     "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
    FunctionTemplate("sum_to_n", "loops", "sum_to_n", "n:nat",
                     "returns the sum of the whole numbers from 1 to n (0 when n is 0)", "    return n * (n + 1) // 2"),
    FunctionTemplate("sum_multiples_to_n", "loops", "sum_multiples_of_{k}_up_to", "n:nat",
                     "returns the sum of the multiples of {k} from 1 up to n, n included",
                     "    return sum(i for i in range(1, n + 1) if i % {k} == 0)", {"k": tuple(range(2, 10))}),
    FunctionTemplate("fibonacci", "loops", "fibonacci", "n:small_nat",
                     "returns the n-th Fibonacci number, where fibonacci(0) is 0 and fibonacci(1) is 1",
                     "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    FunctionTemplate("sign", "loops", "sign", "x:int",
                     "returns 1 if x is positive, -1 if x is negative and 0 if x is 0",
                     "    return (x > 0) - (x < 0)"),
    FunctionTemplate("countdown", "loops", "countdown", "n:small_nat",
                     "returns the list [n, n - 1, ..., 1] (an empty list when n is 0)",
                     "    return list(range(n, 0, -1))"),
    FunctionTemplate("multiples", "loops", "multiples_of_{k}", "n:small_nat",
                     "returns a list of the first n multiples of {k}, starting with {k}",
                     "    return [{k} * i for i in range(1, n + 1)]", {"k": tuple(range(2, 13))}),
    FunctionTemplate("grade", "loops", "grade_{k}", "score:percent",
                     "returns 'pass' if score is at least {k}, otherwise 'fail'",
                     "    return 'pass' if score >= {k} else 'fail'", {"k": tuple(range(40, 91, 5))}),
    FunctionTemplate("parity_word", "loops", "parity_{even}_{odd}", "x:int",
                     "returns '{even}' if x is even and '{odd}' if x is odd",
                     "    return '{even}' if x % 2 == 0 else '{odd}'",
                     {"even odd": tuple((a, b) for a, b in itertools.permutations(_WORDS[:8], 2))}),
    FunctionTemplate("fizz", "loops", "fizz_{k}", "x:nat",
                     "returns 'Fizz' if x is divisible by {k}, otherwise x converted to a string",
                     "    return 'Fizz' if x % {k} == 0 else str(x)", {"k": tuple(range(2, 13))}),
    FunctionTemplate("fizzbuzz", "loops", "fizzbuzz_{a}_{b}", "x:nat",
                     "returns 'FizzBuzz' if x is divisible by both {a} and {b}, 'Fizz' if only by {a}, 'Buzz' if "
                     "only by {b}, otherwise x converted to a string",
                     "    if x % {a} == 0 and x % {b} == 0:\n        return 'FizzBuzz'\n    if x % {a} == 0:\n"
                     "        return 'Fizz'\n    if x % {b} == 0:\n        return 'Buzz'\n    return str(x)",
                     {"a": tuple(range(2, 8)), "b": tuple(range(2, 8))}, lambda s: math.gcd(s["a"], s["b"]) == 1),
    FunctionTemplate("count_divisors", "loops", "count_divisors", "n:positive",
                     "returns how many positive whole numbers divide n exactly",
                     "    return sum(1 for d in range(1, n + 1) if n % d == 0)"),
    FunctionTemplate("gcd", "loops", "gcd", "a:positive b:positive",
                     "returns the greatest common divisor of a and b",
                     "    while b:\n        a, b = b, a % b\n    return a"),
    FunctionTemplate("is_prime", "loops", "is_prime", "n:nat",
                     "returns True if n is a prime number, otherwise False",
                     "    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))"),
)  # fmt: skip
