"""`bapo study`'s task: small arithmetic questions in chat form, generated in-house, checked exactly.

    user:      "What is 7 + 15? Answer with just the number."   (in the model's chat template)
    assistant: "22"                           correct when the last integer of the reply is 22

Every problem of the space (a op b, a and b in their ranges, every op of `ops`) is listed once,
shuffled by `seed`, and cut in two: the first `n_heldout` are the held-out set, the rest the
training rows, so no held-out question is ever trained on. Replies are short: SmolLM2-135M mostly
restates the sum before answering ("16 + 13 = 29", 8-10 tokens, one digit a token), so the entropy
split by token kind separates digits (the operands restated and the answer: entropy/digit) from the
words, spaces, "+" and "=" around them (entropy/other).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_INTEGER = re.compile(r"-?\d+")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_WORDS = {"+": "+", "-": "-", "*": "times"}


@dataclass(frozen=True)
class ArithTaskConfig:
    """Which questions exist ("What is a op b?", a in [a_min, a_max], b in [b_min, b_max]; "-"
    only where a >= b) and how they are split."""

    ops: tuple[str, ...] = ("+",)
    a_min: int = 2
    a_max: int = 19
    b_min: int = 2
    b_max: int = 29
    n_heldout: int = 200
    n_train: int = 2000  # at most; fewer when the space is smaller (here 504 - 200 = 304)
    seed: int = 0
    suffix: str = " Answer with just the number."  # after the question, in the user turn
    system_prompt: str | None = None  # None: the chat template's own (SmolLM2's default system turn)
    max_new_tokens: int = 10

    def __post_init__(self):
        unknown = [op for op in self.ops if op not in _OPS]
        if unknown or not self.ops:
            raise ValueError(f"ops={self.ops!r}: each must be one of {tuple(_OPS)}")
        if not (self.a_min <= self.a_max and self.b_min <= self.b_max):
            raise ValueError("a_min <= a_max and b_min <= b_max are required")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: a budget of at least 1 token is required")


SPACE_FORMAT = "OP:A_MIN-A_MAX:B_MIN-B_MAX:BUDGET"


def task_from_spec(text: str, base: ArithTaskConfig | None = None) -> ArithTaskConfig:
    """`base` (the defaults when None) over another space, from "OP:A_MIN-A_MAX:B_MIN-B_MAX:BUDGET"
    (e.g. "*:2-19:2-29:64": products, a in 2-19, b in 2-29, replies of <= 64 tokens; OP may name
    several ops, "+*": sums and products). ValueError naming the format when the text does not
    parse or the space is empty."""
    from dataclasses import replace

    try:
        op, a_text, b_text, budget = text.split(":")
        (a_min, a_max), (b_min, b_max) = (tuple(int(n) for n in part.split("-")) for part in (a_text, b_text))
        fields = dict(ops=tuple(op), a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max, max_new_tokens=int(budget))
        cfg = replace(base or ArithTaskConfig(), **fields)
        if not operands(cfg):
            raise ValueError("no question in this space (a - b needs some a >= b)")
        return cfg
    except ValueError as err:
        raise ValueError(f"{text!r}: {SPACE_FORMAT} expected, e.g. '*:2-19:2-29:64' ({err})") from None


def task_spec(cfg: ArithTaskConfig) -> str:
    """task_from_spec's text for cfg's space."""
    return f"{''.join(cfg.ops)}:{cfg.a_min}-{cfg.a_max}:{cfg.b_min}-{cfg.b_max}:{cfg.max_new_tokens}"


def question(a: int, op: str, b: int, suffix: str = "") -> str:
    return f"What is {a} {_WORDS[op]} {b}?{suffix}"


def operands(cfg: ArithTaskConfig) -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer) of the space once, in order ("-" only where a >= b)."""
    return [
        (a, op, b, _OPS[op](a, b))
        for op in cfg.ops
        for a in range(cfg.a_min, cfg.a_max + 1)
        for b in range(cfg.b_min, cfg.b_max + 1)
        if op != "-" or a >= b
    ]


def problems(cfg: ArithTaskConfig) -> list[dict]:
    """Every question of the space once, as rows {"prompt", "answer"} (answer a string)."""
    return [{"prompt": question(a, op, b, cfg.suffix), "answer": str(answer)} for a, op, b, answer in operands(cfg)]


def make_split(cfg: ArithTaskConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows), disjoint: the space shuffled by cfg.seed, the first n_heldout
    held out. ValueError when the space has no room for training rows."""
    rows = problems(cfg)
    random.Random(cfg.seed).shuffle(rows)
    if len(rows) <= cfg.n_heldout:
        raise ValueError(f"n_heldout={cfg.n_heldout}: the task has only {len(rows)} questions; widen the ranges")
    return rows[cfg.n_heldout : cfg.n_heldout + cfg.n_train], rows[: cfg.n_heldout]


def verify(response: str, row: dict) -> float:
    """1.0 when the last integer in the response (thousands commas ignored) equals the answer."""
    found = _INTEGER.findall(response.replace(",", ""))
    return 1.0 if found and found[-1] == str(int(row["answer"])) else 0.0
