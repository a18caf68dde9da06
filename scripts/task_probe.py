"""How often the start policy solves candidate task formats, before any RL: the measurement
behind the study's choice of task (docs/STUDY.md, "Why this task").

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/task_probe.py                 # markdown table (after make vllm)
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/task_probe.py --json out.json
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/task_probe.py --share --questions 64 --samples 8 --temperatures 0.7
    ... --share --task '*:2-12:2-19:64' --task=-:20-99:2-49:64    # other spaces of the study's task ('=' before a '-')

Each candidate is a prompt format (system turn, user turn) over a range of operands; `--questions`
of its questions (drawn with `--seed`) are sampled `--samples` times each by vLLM at every
temperature of `--temperatures`, in fp32 (eager: a probe is too short to repay vLLM's compile),
and scored by the study's own check (the last integer of the reply, bapo.experiments.arith.verify). A
task suits GRPO when the start policy solves a fair share of it (neither ~0, where no group holds
a positive sample, nor ~1): the study looked for 10-60% (docs/STUDY.md).
Columns: accuracy per temperature, tokens per reply and the share of replies cut at the budget
(both at the first temperature).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from bapo.experiments.arith import ArithTaskConfig, operands, question, task_from_spec, verify
from bapo.train.data import format_prompt

_JUST = "What is {a} + {b}? Answer with just the number."


@dataclass(frozen=True)
class Candidate:
    name: str
    user: str  # format string over {a}, {b}
    system: str | None  # None: the chat template's own system turn
    a_range: tuple[int, int]
    b_range: tuple[int, int]
    budget: int  # new tokens
    op: str = "+"


CANDIDATES = (
    Candidate(
        "word problem, add",
        "Tom has {a} apples and gets {b} more. How many apples does Tom have now?",
        "Answer with the number only.",
        (10, 49),
        (10, 49),
        32,
    ),
    Candidate(
        "word problem, subtract",
        "Tom has {a} apples and gives away {b}. How many apples does Tom have now?",
        "Answer with the number only.",
        (50, 99),
        (10, 49),
        32,
        "-",
    ),
    Candidate(
        "2-digit, 'The answer is'",
        "What is {a} + {b}?",
        "Start your reply with 'The answer is' and then the number.",
        (10, 99),
        (10, 99),
        16,
    ),
    Candidate(
        "a 2-9 + b 2-19, calculator",
        "{a} + {b} =",
        "You are a calculator. Reply with only the number.",
        (2, 9),
        (2, 19),
        12,
    ),
    Candidate("a 2-9 + b 2-19, just the number", _JUST, None, (2, 9), (2, 19), 12),
    Candidate(
        "a 2-9 + b 2-19, 'The answer is N'",
        "What is {a} + {b}?",
        "Reply in the form: The answer is N.",
        (2, 9),
        (2, 19),
        12,
    ),
    Candidate(
        "a, b 10-49, calculator",
        "{a} + {b} =",
        "You are a calculator. Reply with only the number.",
        (10, 49),
        (10, 49),
        12,
    ),
    Candidate("a, b 10-49, just the number", _JUST, None, (10, 49), (10, 49), 12),
)


def study_candidate(budget: int | None = None, a_range=None, b_range=None, op: str = "+") -> Candidate:
    """The study's task as it is configured (bapo.experiments.arith defaults), for comparison; with
    another budget, operand ranges or operation for the regime probe (--share, --task)."""
    cfg = ArithTaskConfig()
    a_range, b_range = a_range or (cfg.a_min, cfg.a_max), b_range or (cfg.b_min, cfg.b_max)
    return Candidate(
        f"study task (a {a_range[0]}-{a_range[1]} {op} b {b_range[0]}-{b_range[1]}, just the number)",
        question("{a}", op, "{b}", cfg.suffix),  # the study's own question, as a format string
        cfg.system_prompt,
        a_range,
        b_range,
        cfg.max_new_tokens if budget is None else budget,
        op,
    )


def task_candidate(text: str) -> Candidate:
    """--task OP:A_MIN-A_MAX:B_MIN-B_MAX:BUDGET (e.g. '*:2-12:2-19:64'): the study's prompt over
    another space of bapo.experiments.arith (what `bapo study --task` trains on)."""
    try:
        cfg = task_from_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if len(cfg.ops) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the probe takes one op per candidate (OP one of + - *)")
    return study_candidate(cfg.max_new_tokens, (cfg.a_min, cfg.a_max), (cfg.b_min, cfg.b_max), cfg.ops[0])


# --share: where BAPO's premise holds at the start (docs/STUDY.md, "The regime gate"): the study's
# prompt at three budgets, and harder operands
REGIME_CANDIDATES = (
    study_candidate(10),
    study_candidate(64),
    study_candidate(128),
    study_candidate(64, (20, 99), (20, 99)),
)


def share_at_ratio_one(groups: list[list[tuple[float, int]]], target: float = 0.4) -> dict:
    """The positive share of the loss at ratio 1 under token-mean aggregation with the trainer's
    group-normalised advantages (bapo.core.group_advantages), from (reward, length) of each group's
    replies (groups of one size). A group's advantages sum to zero, so a mixed group's share is
    Lc / (Lc + Lw) (mean lengths of its correct and wrong replies); "pooled" sums the positive and
    negative parts of every mixed group (what one update of these groups sees)."""
    import torch

    from bapo.core import group_advantages

    rewards = torch.tensor([[reward for reward, _ in group] for group in groups])  # [groups, G]
    lengths = torch.tensor([[length for _, length in group] for group in groups], dtype=torch.float64)
    advantages, zero_variance = group_advantages(rewards.reshape(-1), rewards.shape[1])
    signed = advantages.double().reshape(rewards.shape) * lengths  # A x length, summed per sign below
    mixed = ~zero_variance.reshape(rewards.shape)[:, 0]
    positive, negative = signed.clamp(min=0).sum(1)[mixed], (-signed).clamp(min=0).sum(1)[mixed]
    shares = positive / (positive + negative)
    correct = rewards > 0
    return {
        "length_correct": lengths[correct].mean().item() if correct.any() else float("nan"),
        "length_wrong": lengths[~correct].mean().item() if (~correct).any() else float("nan"),
        "mixed_groups": int(mixed.sum()),
        "pooled_share": (positive.sum() / (positive.sum() + negative.sum())).item() if mixed.any() else float("nan"),
        "groups_below_target": (shares < target).double().mean().item() if mixed.any() else 0.0,
    }


def questions(candidate: Candidate, n: int, seed: int) -> list[tuple[int, int, int]]:
    """n (a, b, answer) drawn without replacement from the candidate's operand space (the study
    task's enumeration, bapo.experiments.arith.operands, over the candidate's ranges and op)."""
    (a_min, a_max), (b_min, b_max) = candidate.a_range, candidate.b_range
    space = ArithTaskConfig(ops=(candidate.op,), a_min=a_min, a_max=a_max, b_min=b_min, b_max=b_max)
    drawn = [(a, b, answer) for a, _, b, answer in operands(space)]
    return random.Random(seed).sample(drawn, min(n, len(drawn)))


def probe(
    model_path: str, candidates, n_questions: int, samples: int, temperatures, seed: int, share: bool = False
) -> list[dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as the study's engine (rollout.vllm_kv_cache_gb)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    llm = LLM(
        model=model_path, dtype="float32", seed=seed, max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True
    )
    rows = []
    for candidate in candidates:
        drawn = questions(candidate, n_questions, seed)
        # the trainer's own prompt path (bapo.train.data): chat template, then the tokenizer
        texts = [format_prompt(candidate.user.format(a=a, b=b), tokenizer, True, candidate.system) for a, b, _ in drawn]
        prompts = [
            TokensPrompt(prompt_token_ids=ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]
        ]
        row: dict = {
            "candidate": candidate.name,
            "budget": candidate.budget,
            "questions": len(drawn),
            "samples": samples,
        }
        for index, temperature in enumerate(temperatures):
            # no per-request seed: vLLM on CPU cannot rewind a seeded generator under chunked
            # prefill; the engine's global seed (LLM(seed=...)) makes the whole probe repeatable
            params = SamplingParams(n=samples, temperature=temperature, max_tokens=candidate.budget)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            replies = [
                (completion, answer) for output, (_, _, answer) in zip(outputs, drawn) for completion in output.outputs
            ]
            row[f"accuracy_T{temperature}"] = sum(
                verify(c.text, {"answer": str(answer)}) for c, answer in replies
            ) / len(replies)
            if index == 0 and share:
                groups = [
                    [(verify(c.text, {"answer": str(answer)}), len(c.token_ids)) for c in output.outputs]
                    for output, (_, _, answer) in zip(outputs, drawn)
                ]
                row |= share_at_ratio_one(groups)
            if index == 0:
                row["tokens_per_reply"] = sum(len(c.token_ids) for c, _ in replies) / len(replies)
                row["cut_at_budget"] = sum(c.finish_reason == "length" for c, _ in replies) / len(replies)
                row["example"] = replies[0][0].text
        rows.append(row)
    return rows


def markdown(rows: list[dict], temperatures) -> str:
    head = (
        ["candidate"]
        + [f"T={t} accuracy" for t in temperatures]
        + [
            "tokens / reply (budget)",
            f"cut at budget (T={temperatures[0]})",
            "first reply (first question, first temperature)",
        ]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["candidate"]] + [f"{row[f'accuracy_T{t}']:.3f}" for t in temperatures]
        cells += [
            f"{row['tokens_per_reply']:.1f} ({row['budget']})",
            f"{row['cut_at_budget']:.0%}",
            repr(row["example"][:40]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if rows and "pooled_share" in rows[0]:
        lines += [
            "",
            f"| candidate | budget | length correct / wrong (T={temperatures[0]}) | mixed groups | "
            "pooled share at ratio 1 | mixed groups below 0.4 |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {row['candidate']} | {row['budget']} | {row['length_correct']:.1f} / {row['length_wrong']:.1f} | "
            f"{row['mixed_groups']} | {row['pooled_share']:.3f} | {row['groups_below_target']:.0%} |"
            for row in rows
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=str(Path.home() / ".cache/bapo/smollm2-135m-instruct"),
        help="an HF model folder (bapo smollm2 writes this one)",
    )
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--share",
        action="store_true",
        help="the regime probe: the study prompt at budgets 10/64/128 and operands 20-99, with the positive "
        "share at ratio 1 and the lengths of correct and wrong replies (use --samples 8: GRPO's groups)",
    )
    parser.add_argument(
        "--task",
        type=task_candidate,
        action="append",
        help="with --share: probe this space instead of the default four, OP:A_MIN-A_MAX:B_MIN-B_MAX:BUDGET "
        "(OP + - or *; repeat the option), e.g. --task '*:2-12:2-19:64' or --task=-:20-99:2-49:64",
    )
    args = parser.parse_args()
    if args.task and not args.share:
        parser.error("--task goes with --share (the regime probe)")
    if not (Path(args.model) / "config.json").exists():
        parser.error(f"--model {args.model}: no config.json there; run `bapo smollm2` first or pass an HF model folder")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    candidates = (args.task or REGIME_CANDIDATES) if args.share else (*CANDIDATES, study_candidate())
    rows = probe(args.model, candidates, args.questions, args.samples, temperatures, args.seed, share=args.share)
    print(markdown(rows, temperatures))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
