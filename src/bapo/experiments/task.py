"""The built-in reasoning task: countdown-style guess-and-check.

The prompt lists a few small numbers and a target; the response tries one pair at a time,
one attempt per line, and stops at the first attempt that hits the target:

    prompt:   "7,12,5>17:"
    response: "12-7=5\\n7+12=19\\n12+5=17"          (then EOS)

Exactly one attempt (one pair, "+" or larger "-" smaller) hits the target, so a policy that
picks attempts blindly needs on average half the candidates; attempts that miss cost tokens,
and a response that has not hit the target when the token budget runs out is a failure.
So failures are structurally longer than successes (they run to the budget), and what RL can
learn is which attempt to try first (a target above every number is a sum, its last digit
is the last digit of the two numbers' sum, ...): a strategy, not a format.
The warm start imitates demonstrations that try the candidates in a random order, so the
start policy is uncertain at every attempt (entropy well above zero) and correct on roughly
as many prompts as the budget allows blind tries.
The held-out split is fixed by its own seed and never appears in the training rows.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

_PROMPT = re.compile(r"(\d+(?:,\d+)+)>(\d+):")
_ATTEMPT = re.compile(r"(\d+)([+-])(\d+)=(-?\d+)")


@dataclass(frozen=True)
class TaskConfig:
    """Which problems exist: `n_numbers` numbers in [1, max_number]; the target is the result
    of exactly one candidate attempt (a pair, "+" or larger "-" smaller)."""

    n_numbers: int = 3
    max_number: int = 9
    # the response budget: about 3 attempts ("7+5=12" + newline is 7 tokens); a response
    # that has not hit the target by then is cut off, so every failure is this long
    max_new_tokens: int = 20
    n_train: int = 2000
    n_heldout: int = 128
    train_seed: int = 0
    heldout_seed: int = 12345


def candidates(numbers: list[int]) -> list[str]:
    """Every attempt over two different positions: "a+b" (prompt order) and "big-small"."""
    out = []
    for i, j in itertools.combinations(range(len(numbers)), 2):
        a, b = numbers[i], numbers[j]
        out.append(f"{a}+{b}")
        out.append(f"{max(a, b)}-{min(a, b)}")
    return out


def evaluate_attempt(attempt: str) -> int:
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", attempt).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def format_prompt(numbers: list[int], target: int) -> str:
    return ",".join(map(str, numbers)) + f">{target}:"


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    match = _PROMPT.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"prompt {prompt!r} is not a task prompt 'n1,n2,...>target:'")
    return [int(x) for x in match.group(1).split(",")], int(match.group(2))


def is_task_prompt(text: str) -> bool:
    return _PROMPT.fullmatch(text.strip()) is not None


def sample_problem(rng: random.Random, cfg: TaskConfig) -> tuple[list[int], int]:
    """(numbers [n_numbers], target): the target is hit by exactly one candidate attempt."""
    while True:
        numbers = [rng.randint(1, cfg.max_number) for _ in range(cfg.n_numbers)]
        results = [evaluate_attempt(c) for c in candidates(numbers)]
        unique = [r for r in results if results.count(r) == 1 and r > 0]
        if unique:
            return numbers, rng.choice(unique)


def worked_solution(numbers: list[int], target: int, rng: random.Random | None = None) -> str:
    """Attempts in a random order (prompt order without `rng`) up to the one that hits the target."""
    order = candidates(numbers)
    if rng is not None:
        rng.shuffle(order)
    lines = []
    for attempt in order:
        value = evaluate_attempt(attempt)
        lines.append(f"{attempt}={value}")
        if value == target:
            break
    return "\n".join(lines)


def verify(response: str, row: dict) -> float:
    """1.0 when every line is a true attempt "a+b=c" / "a-b=c" over two different numbers of
    the prompt (a >= b for "-") and the last line hits the target; 0.0 otherwise (a wrong sum,
    a number not in the prompt, no hit before the budget ran out, stray text)."""
    try:
        numbers, target = parse_prompt(row["prompt"])
    except ValueError:
        return 0.0
    lines = response.strip().split("\n")
    for line in lines:
        match = _ATTEMPT.fullmatch(line.strip())
        if match is None:
            return 0.0
        a, op, b, value = int(match.group(1)), match.group(2), int(match.group(3)), int(match.group(4))
        pool = list(numbers)
        if a not in pool:
            return 0.0
        pool.remove(a)
        if b not in pool or (op == "-" and a < b):
            return 0.0
        if value != (a + b if op == "+" else a - b):
            return 0.0
    return float(value == target)


def _unique_problems(rng: random.Random, cfg: TaskConfig, n: int, exclude: set[str]):
    seen = set(exclude)
    attempts = 0
    while n > 0:
        attempts += 1
        if attempts > 200 * (n + len(seen)):
            raise ValueError(
                f"TaskConfig(max_number={cfg.max_number}) has too few distinct "
                "problems: raise max_number or lower n_train / n_heldout"
            )
        numbers, target = sample_problem(rng, cfg)
        prompt = format_prompt(numbers, target)
        if prompt in seen:
            continue
        seen.add(prompt)
        n -= 1
        yield numbers, target, prompt


def make_split(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows); each row {"prompt", "answer"} (answer = the hitting attempt).

    The held-out rows depend only on (n_numbers, max_number, n_heldout, heldout_seed), and no
    training prompt equals a held-out prompt.
    """

    def row(numbers, target, prompt):
        hit = next(c for c in candidates(numbers) if evaluate_attempt(c) == target)
        return {"prompt": prompt, "answer": hit}

    heldout = [row(*p) for p in _unique_problems(random.Random(cfg.heldout_seed), cfg, cfg.n_heldout, set())]
    taken = {r["prompt"] for r in heldout}
    train = [row(*p) for p in _unique_problems(random.Random(cfg.train_seed), cfg, cfg.n_train, taken)]
    return train, heldout


def demonstrations(rows: list[dict], seed: int) -> list[str]:
    """SFT texts: prompt + attempts in a fresh random order per row, up to the hit."""
    rng = random.Random(seed)
    return [r["prompt"] + worked_solution(*parse_prompt(r["prompt"]), rng) for r in rows]
