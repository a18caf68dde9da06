"""Verifiers: (response text, example row) -> reward, and a scorer that never stops training.

A verifier that raises or runs past its timeout gives reward 0 and is counted as a failure.
They run in threads so that a hung one can be abandoned (threads cannot be killed; the stray
thread is left to finish on its own).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import logging
import re
from functools import partial
from typing import Callable, Protocol

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
        if not any(isinstance(f, _DropTimeoutNotice) for f in log.filters):
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
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward.verifier={name!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward.verifier={name!r} is not callable")
    return fn


def score(verifier: Callable[[str, dict], float], responses: list[str], examples: list[dict],
          timeout_s: float) -> tuple[torch.Tensor, int]:
    """Rewards [N] float32 and the number of verifier failures (raised, timed out, non-finite).

    One thread per call, all started at once, so every call gets timeout_s of wall time and the
    batch waits at most timeout_s."""
    if not responses:
        return torch.zeros(0), 0
    pool = cf.ThreadPoolExecutor(max_workers=len(responses))
    futures = [pool.submit(verifier, r, e) for r, e in zip(responses, examples)]
    done, _ = cf.wait(futures, timeout=timeout_s)
    rewards, failures = [], 0
    for fut in futures:
        try:
            value = float(fut.result(timeout=0)) if fut in done else None
        except Exception:  # a buggy verifier must not stop training
            value = None
        if value is None or value != value or value in (float("inf"), float("-inf")):
            failures += 1
            value = 0.0
        rewards.append(value)
    pool.shutdown(wait=False, cancel_futures=True)
    return torch.tensor(rewards, dtype=torch.float32), failures
