"""The built-in reasoning task: chained additions and subtractions solved step by step.

A problem is a left-to-right chain of small integers, the worked answer writes one step per
line and ends with the final value:

    prompt:   "12+7-5="
    response: "12+7=19\\n19-5=14\\nanswer:14"

`difficulty` sets the number of terms (difficulty + 1) and how large the operands get, so the
same code gives a warm-up task for a 100k-parameter model or a harder one for a bigger model.
The held-out split is fixed by its own seed and never appears in the training rows.
Demonstrations can carry injected slips (a step result off by a little, propagated to the
end) so that a model trained on them starts out neither hopeless nor perfect.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

ANSWER_PREFIX = "answer:"
_ANSWER_LINE = re.compile(r"answer:(-?\d+)")
_STEP_LINE = re.compile(r"-?\d+[+-]\d+=-?\d+")
_PROMPT = re.compile(r"\d+(?:[+-]\d+)+=")


@dataclass(frozen=True)
class TaskConfig:
    """Which problems exist. `difficulty` d: d+1 terms, operands in [1, 3 d + 3]."""

    difficulty: int = 2
    n_train: int = 2000
    n_heldout: int = 128
    train_seed: int = 0
    heldout_seed: int = 12345

    @property
    def n_terms(self) -> int:
        return self.difficulty + 1

    @property
    def max_operand(self) -> int:
        return 3 * self.difficulty + 3


def sample_problem(rng: random.Random, cfg: TaskConfig) -> tuple[list[int], list[str]]:
    """One chain: terms [n_terms] and the operators between them [n_terms - 1]."""
    terms = [rng.randint(1, cfg.max_operand) for _ in range(cfg.n_terms)]
    ops = [rng.choice("+-") for _ in range(cfg.n_terms - 1)]
    return terms, ops


def format_prompt(terms: list[int], ops: list[str]) -> str:
    return str(terms[0]) + "".join(op + str(t) for op, t in zip(ops, terms[1:])) + "="


def is_task_prompt(text: str) -> bool:
    return _PROMPT.fullmatch(text) is not None


def solve(terms: list[int], ops: list[str]) -> int:
    value = terms[0]
    for op, t in zip(ops, terms[1:]):
        value = value + t if op == "+" else value - t
    return value


def worked_solution(terms: list[int], ops: list[str], rng: random.Random | None = None,
                    slip_rate: float = 0.0) -> tuple[str, int]:
    """The step-by-step response and the final value it states.

    With `slip_rate` > 0 each step result is, with that probability, off by one of
    {-10, -2, -1, +1, +2, +10}; later steps continue from the wrong value (as a careless
    student would), so the stated answer is wrong but the text stays well formed.
    """
    lines, value = [], terms[0]
    for op, t in zip(ops, terms[1:]):
        result = value + t if op == "+" else value - t
        if rng is not None and slip_rate > 0 and rng.random() < slip_rate:
            result += rng.choice((-10, -2, -1, 1, 2, 10))
        lines.append(f"{value}{op}{t}={result}")
        value = result
    lines.append(f"{ANSWER_PREFIX}{value}")
    return "\n".join(lines), value


def parse_answer(response: str) -> int | None:
    """The final answer of a response, or None when the response is malformed.

    Well formed = zero or more step lines "a+b=c" / "a-b=c", then exactly one last line
    "answer:N"; anything else (missing or repeated answer, stray text) is malformed.
    """
    lines = response.strip().split("\n")
    *steps, last = lines
    match = _ANSWER_LINE.fullmatch(last.strip())
    if match is None or not all(_STEP_LINE.fullmatch(s.strip()) for s in steps):
        return None
    return int(match.group(1))


def verify(response: str, row: dict) -> float:
    """Reward 1.0 when the response is well formed and its answer equals row["answer"]."""
    answer = parse_answer(response)
    return float(answer is not None and str(answer) == str(row["answer"]).strip())


def _unique_problems(rng: random.Random, cfg: TaskConfig, n: int, exclude: set[str]):
    seen = set(exclude)
    attempts = 0
    while n > 0:
        attempts += 1
        if attempts > 200 * (n + len(seen)):
            raise ValueError(f"difficulty {cfg.difficulty} has too few distinct problems")
        terms, ops = sample_problem(rng, cfg)
        prompt = format_prompt(terms, ops)
        if prompt in seen:
            continue
        seen.add(prompt)
        n -= 1
        yield terms, ops, prompt


def make_split(cfg: TaskConfig) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows); each row {"prompt", "answer", "solution"}.

    The held-out rows depend only on (difficulty, n_heldout, heldout_seed), and no
    training prompt equals a held-out prompt.
    """
    def row(terms, ops, prompt):
        return {"prompt": prompt, "answer": str(solve(terms, ops)),
                "solution": worked_solution(terms, ops)[0]}

    heldout = [row(*p) for p in _unique_problems(random.Random(cfg.heldout_seed), cfg,
                                                  cfg.n_heldout, set())]
    taken = {r["prompt"] for r in heldout}
    train = [row(*p) for p in _unique_problems(random.Random(cfg.train_seed), cfg,
                                                cfg.n_train, taken)]
    return train, heldout


def demonstrations(rows: list[dict], slip_rate: float, seed: int) -> list[str]:
    """SFT texts prompt + worked solution, a `slip_rate` share of steps slipped."""
    rng = random.Random(seed)
    texts = []
    for r in rows:
        terms = [int(x) for x in re.findall(r"\d+", r["prompt"])]
        ops = re.findall(r"[+-]", r["prompt"])
        texts.append(r["prompt"] + worked_solution(terms, ops, rng, slip_rate)[0])
    return texts


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def task_settings(cfg: TaskConfig) -> dict:
    return asdict(cfg)


def eval_verifier(name: str, rows: list[dict] | None = None):
    """The verifier `bapo eval --verifier NAME` uses: "demo" (this task's strict checker),
    "auto" (demo when every row is a prompt of this task, else "math"), or any bapo.train
    verifier name ("math", "exact", "pkg.module:attr")."""
    if name == "auto":
        name = "demo" if rows and all(is_task_prompt(r["prompt"]) for r in rows) else "math"
    if name == "demo":
        return verify
    from bapo.train import resolve_verifier

    return resolve_verifier(name)
