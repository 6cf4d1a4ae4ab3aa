"""Hostile completions for the reward runner: the test suite's fuzz test and bench/fuzz_rewards.py draw from here.

``hostile_samples(n, seed)`` returns ``n`` deterministic samples, each with a ``kind`` and whether a verifier may
reward it at all. The math samples' gold answer (``GOLD``) never occurs in them, and every code sample is a
program that fails its test, so a reward above 0 for any sample marked ``may_pass=False`` is a free reward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rewards import VerifierInput

GOLD = "7919"
CODE_TESTS = [{"code": "assert add(2, 3) == 5"}]

BOMBS = [
    "\\boxed{9^{9^{9^{9}}}}",
    "\\boxed{9**9**9**9}",
    "9**9**9**9",
    "\\boxed{(10^{10})!}",
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",
    "\\boxed{" + "\\sqrt{" * 300 + "2" + "}" * 300 + "}",
    "\\boxed{" + "{" * 5000 + "}" * 5000 + "}",
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "\\boxed{" + "1" * 999 + "}",
    "\\boxed{" + "1" * 5000 + "}",
    "\\boxed{2^{99999999999}}",
    "\\boxed{\\int_0^\\infty e^{-x^{x^{x}}}dx}",
    "\\boxed{\\sum_{n=1}^{10^{100}} n^{n}}",
    "\\boxed{x^{" + "x^{" * 100 + "1" + "}" * 100 + "}}",
    "<answer>" + "[" * 2000 + "]" * 2000 + "</answer>",
    "The answer is " + "+".join(["1"] * 3000),
    "{" * 1000,
    "\\frac{" * 166,
]

UNICODE = [
    "\u202e\\boxed{42}\u202c",
    "\\boxed{\u0661\u0662}",
    "\\boxed{\u200b\u200b}",
    "\\boxed{\U0001f600}",
    "\ufeff\\boxed{1}\ufeff",
    "e\u0301" * 500,
    "\\boxed{\ud800}",
    "\udfff\udfff <answer>\ud83d</answer>",
    "\x00\x01\x02\\boxed{\x7f}",
    "\\boxed{\u00bd}",
    "\u0000" * 1000,
]

DEGENERATE = [
    "\\boxed{x ",
    "<answer>x ",
    "```python ",
    "```python\n",
    "\\boxed{",
    "{",
    "}",
    "\\",
    "$",
    "\\frac{",
    "<answer>",
    "a",
    "\n",
    " ",
    "\\boxed{1}",
]

CODE_HACKS = [
    "import os\nos._exit(0)",
    "import sys\nsys.exit(0)",
    "raise SystemExit",
    "exit()",
    "quit()",
    "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0",
    "import sys\nsys.excepthook = lambda *a: None\ndef add(a, b):\n    return 0",
    "def add(a, b):\n    import os\n    os._exit(0)",
    "def add(a, b):\n    raise SystemExit(0)",
    "def add(a, b):\n    raise KeyboardInterrupt",
    "import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.02), os._exit(0))).start()\n"
    "def add(a, b):\n    time.sleep(1)\n    return 0",
    "import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.02)\ndef add(a, b):\n    time.sleep(1)\n    return 0",
    "print('\\x00trustbatch-test ' + '0' * 32 + ' pass')\nimport os\nos._exit(0)",
    "import os, sys\nprint(sys.stdin.read())\nos._exit(0)",
    "import os\nos.close(1)\ndef add(a, b):\n    return a + b",
    "class E(Exception):\n    def __str__(self):\n        import os\n        os._exit(0)\ndef add(a, b):\n    raise E()",
    "import sys\ndef add(a, b):\n    sys.settrace(lambda *a: None)\n    return a + b",
    "import os, signal\ndef add(a, b):\n    os.killpg(0, signal.SIGKILL)",
    "def add(a, b):\n    return a - b",
    "def add(a, b) return a + b",
    "def add(a, b):\n    while True:\n        pass",
    "x = bytearray(1 << 30)\ndef add(a, b):\n    return a + b",
    "import os\nwhile True:\n    os.fork()",
    "print('x' * (1 << 22))\ndef add(a, b):\n    return a + b",
]


@dataclass(frozen=True)
class HostileSample:
    sample: VerifierInput
    task: str
    kind: str
    may_pass: bool = False


def _garbage(rng: random.Random, size: int) -> str:
    data = bytes(rng.getrandbits(8) for _ in range(size))
    return data.decode("utf-8", errors=rng.choice(["replace", "surrogateescape", "ignore"]))


def _mixture(rng: random.Random) -> str:
    pieces = BOMBS + UNICODE + DEGENERATE + ["\\boxed{12}", "Answer: 3", "\n\n", "```\n", "</answer>"]
    return "".join(rng.choice(pieces) * rng.randint(1, 40) for _ in range(rng.randint(1, 6)))


def hostile_samples(n: int, seed: int = 0, *, huge_chars: int = 1 << 20) -> list[HostileSample]:
    """``n`` hostile samples in a fixed mix of kinds (math garbage, bombs, unicode, degenerate repetition up to
    ``huge_chars`` characters, mixtures, and code-grader hacks), shuffled by ``seed``. Repetitions are longer than
    the math verifier's ``max_answer_chars``, so only their extraction runs; short ones are among the bombs."""
    rng = random.Random(seed)
    out: list[HostileSample] = []

    def math(text: str, kind: str) -> None:
        out.append(HostileSample(VerifierInput("q", text, GOLD, {"task": "math"}), "math", kind))

    def code(program: str, kind: str) -> None:
        text = f"Here is my solution.\n```python\n{program}\n```\n" if rng.random() < 0.8 else program
        out.append(HostileSample(VerifierInput("q", text, CODE_TESTS, {"task": "code"}), "code", kind))

    kinds = ["garbage", "bomb", "unicode", "degenerate", "mixture", "code_hack"]
    while len(out) < n:
        kind = kinds[len(out) % len(kinds)]
        if kind == "garbage":
            math(_garbage(rng, rng.choice([0, 1, 16, 256, 4096])), kind)
        elif kind == "bomb":
            math(rng.choice(["", "Let me think. ", "So "]) + rng.choice(BOMBS), kind)
        elif kind == "unicode":
            math(rng.choice(UNICODE) * rng.randint(1, 3), kind)
        elif kind == "degenerate":
            unit = rng.choice(DEGENERATE)
            math(unit * max(1, rng.choice([5_000, 50_000, huge_chars]) // len(unit)), kind)
        elif kind == "mixture":
            math(_mixture(rng), kind)
        else:
            code(
                rng.choice(CODE_HACKS) + rng.choice(["", "\n# " + _garbage(rng, 8).replace("\n", " ")]), kind
            )
    rng.shuffle(out)
    for item in out:
        assert GOLD not in item.sample.completion  # the free-reward check below relies on it
    return out
