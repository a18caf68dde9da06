"""Verifiers: (response text, example row) -> reward, and a scorer that never stops training.

A verifier that raises (anything, SystemExit included), runs past its timeout or returns a
non-number or a value that is not finite in float32 gives reward 0 and is counted as a failure.
They run on a bounded set of daemon threads so that a hung one can be abandoned (threads cannot
be killed; the stray thread finishes on its own and never blocks the process's exit).
"""

from __future__ import annotations

import importlib
import logging
import numbers
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch


class Verifier(Protocol):
    def __call__(self, response: str, example: dict) -> float: ...


def exact_match(response: str, example: dict, answer_key: str = "answer") -> float:
    """1.0 when the response, whitespace-stripped, equals the answer."""
    return float(response.strip() == str(example[answer_key]).strip())


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:/\d+)?")


def extract_answer(response: str) -> str | None:
    """The last \\boxed{...} content, else the last number in the text."""
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(response)
    return numbers[-1].replace(",", "") if numbers else None


class _DropTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _quiet_math_verify() -> None:
    """math-verify warns on every call that its own timeout is off; ours is in `score`."""
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if not any(isinstance(installed, _DropTimeoutNotice) for installed in log.filters):
            log.addFilter(_DropTimeoutNotice())


def math_answer(response: str, example: dict, answer_key: str = "answer") -> float:
    """math-verify equivalence of the extracted answer (boxed or last number) and the gold one."""
    from math_verify import parse, verify

    _quiet_math_verify()
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    gold = str(example[answer_key])
    if predicted.strip() == gold.strip():
        return 1.0
    # timeouts off: math-verify's own use signal.alarm, which only works in the main thread;
    # our thread pool enforces reward.timeout_s instead.
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${predicted}$", parsing_timeout=None)
    return float(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def format_match(response: str, example: dict, pattern: str = r"\\boxed\{.+?\}") -> float:
    return float(re.search(pattern, response, flags=re.DOTALL) is not None)


BUILTIN = {"exact": exact_match, "math": math_answer, "format": format_match}


def resolve_verifier(name: str, answer_key: str = "answer", format_pattern: str = r"\\boxed\{.+?\}") -> Verifier:
    """A built-in name or "package.module:attr" -> callable; raises ValueError naming the fix."""
    if name in BUILTIN:
        if name == "format":
            return partial(format_match, pattern=format_pattern)
        return partial(BUILTIN[name], answer_key=answer_key)
    if ":" not in name:
        raise ValueError(f"reward.verifier={name!r}: use one of {', '.join(BUILTIN)} or 'package.module:attr'")
    module_name, _, attr = name.partition(":")
    if module_name.split(".")[:2] == ["bapo", "demo"]:  # the package was renamed: refused, never guessed at
        moved = "bapo.experiments" + name[len("bapo.demo") :]
        raise ValueError(f"reward.verifier={name!r}: bapo.demo is now bapo.experiments: use {moved!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward.verifier={name!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward.verifier={name!r} is not callable")
    return fn


MAX_WORKERS = 8  # verifier threads per score() call, whatever the number of responses


def _as_reward(value) -> float | None:
    """A verifier's return value as a float32-finite reward, or None (a failure): a reward is a
    real number (not a string such as "1.0") that stays finite in float32 (1e39 does not)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    as_float32 = torch.tensor(float(value), dtype=torch.float32)
    return float(as_float32) if torch.isfinite(as_float32) else None


def score(
    verifier: Callable[[str, dict], float],
    responses: list[str],
    examples: list[dict],
    timeout_s: float,
    workers: int = MAX_WORKERS,
) -> tuple[torch.Tensor, int]:
    """Rewards [N] float32 and the number of verifier failures, each counted and scored 0: raised
    anything (SystemExit and KeyboardInterrupt too), ran past timeout_s, returned a non-number or a
    value that is not finite in float32.

    At most `workers` daemon threads run the calls; each call gets timeout_s of wall time from its
    own start. A call that runs past it is abandoned: its thread is daemon, so it never blocks the
    process's exit, and a fresh thread takes its place for the remaining calls.
    """
    if not responses:
        return torch.zeros(0), 0
    count = len(responses)
    results: list[float | None] = [None] * count
    started: dict[int, float] = {}  # call index -> start time, while running
    finished: set[int] = set()
    abandoned: set[int] = set()
    pending = list(range(count - 1, -1, -1))  # popped from the end: calls start in order
    condition = threading.Condition()

    def work() -> None:
        while True:
            with condition:
                if not pending:
                    return
                call = pending.pop()
                started[call] = time.monotonic()
            try:
                value = _as_reward(verifier(responses[call], examples[call]))
            except BaseException:  # noqa: BLE001 - a verifier must never stop training, not even by SystemExit
                value = None
            with condition:
                if call in abandoned:
                    return  # timed out meanwhile: its slot was handed to a new thread
                results[call] = value
                finished.add(call)
                del started[call]
                condition.notify_all()

    def spawn() -> None:
        threading.Thread(target=work, name="bapo-verifier", daemon=True).start()

    for _ in range(min(workers, count)):
        spawn()
    with condition:
        while len(finished) + len(abandoned) < count:
            now = time.monotonic()
            for call, started_at in list(started.items()):
                if now - started_at >= timeout_s:
                    abandoned.add(call)
                    del started[call]
                    if pending:
                        spawn()
            deadline = min((started_at + timeout_s for started_at in started.values()), default=now + timeout_s)
            condition.wait(timeout=max(deadline - time.monotonic(), 0.001))
    rewards = [0.0 if value is None else value for value in results]
    failures = sum(value is None for value in results)
    return torch.tensor(rewards, dtype=torch.float32), failures
