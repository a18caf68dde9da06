"""Benchmark of the one-pass BAPO bound search on CPU (not a test; prints ratios from one run).

    python bench/bound_search.py [--tokens 1000000 8000000] [--repeats 9] [--json]

Prints, per size: search time / fixed-clip loss forward+backward time (target <= 0.5 at 1M; both the bare
surrogate and bapo's policy_loss with its diagnostics are timed), for the arithmetic bucketing
bapo uses and for the previous `torch.bucketize` against the candidate edges (kept here only
as the comparison row), and for the paper's and the recipe's definitions (clamped contributions:
twice the histogram). Timings are interleaved round-robin and the minimum over repeats is
reported, so that a loaded machine biases every row alike;
search time vs a candidate-by-candidate loop (one masked tensor pass per candidate, the recipe's
way) on a batch where the search moves >= 10 candidates (target >= 5x faster), and the search's
peak extra memory per token (target: O(tokens + candidates), i.e. a constant number of bytes per
token, far below the 8 bytes x candidates per token a [tokens x candidates] tensor would take).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for bench.bound_search in the memory probe

from bapo.core import (  # noqa: E402
    BAPOConfig,
    BoundStats,
    TokenBatch,
    aggregate_loss,
    clipped_surrogate,
    policy_loss,
    token_ratio,
)
from bapo.core.search import search_path, token_contributions  # noqa: E402

CONFIG = BAPOConfig(
    target=0.5, lower_start=0.6, lower_max=0.9, lower_step=0.05, upper_start=1.2, upper_max=3.0, upper_step=0.05
)


class BucketizeStats(BoundStats):
    """The previous bucketing: one binary search of every token against the rounded edges."""

    def _buckets(self, ratio, positive):
        n_lower, n_upper = len(self._lower_grid), len(self._upper_grid)
        table, lower_tail, upper_tail = self._tables_for(ratio.dtype)
        edges = torch.cat([table, torch.stack(lower_tail + upper_tail)]) if lower_tail or upper_tail else table
        edges = edges.sort().values  # lower edges (< 1) then upper edges (> 1)
        below = torch.bucketize(ratio.flatten(), edges, right=True)  # #{edges <= r}
        positive = positive.flatten()
        return torch.where(positive, (below - n_lower).clamp_(min=0), below.clamp(max=n_lower) + n_upper + 1)


def make_batch(tokens: int, seed: int = 0, length: int = 1024):
    """A stale-looking batch: log-ratio spread 0.3, advantages leaning negative so the search moves."""
    generator = torch.Generator().manual_seed(seed)
    batch = tokens // length
    old_log_prob = -torch.rand(batch, length, generator=generator) * 3
    log_prob = old_log_prob + 0.3 * torch.randn(batch, length, generator=generator)
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, length) - 0.35
    mask = torch.rand(batch, length, generator=generator) > 0.1
    return log_prob, old_log_prob, advantages.contiguous(), mask


def best_time(fn, repeats: int) -> float:
    return interleaved_times({"fn": fn}, repeats)["fn"]


def interleaved_times(fns: dict, repeats: int) -> dict[str, float]:
    """Minimum wall time of each function over `repeats` rounds, the functions taking turns."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def per_candidate_loop(batch, config=CONFIG):
    """The recipe's way: one masked pass over every token per visited candidate (tensor ops,
    one host sync each), walking the same path; returns (lower, upper)."""
    for lower_k, upper_j in search_path(config):
        lower, upper = config.lower_grid[lower_k], config.upper_grid[upper_j]
        positive, negative = token_contributions(batch, lower, upper, config)
        positive, negative = positive.sum(), negative.sum()
        total = float(positive + negative)
        if total == 0 or float(positive) / total >= config.target:
            break
    return lower, upper


def search(batch, stats_class=BoundStats, config=CONFIG):
    return stats_class(config).add(batch).solve(sync=False)


def fixed_clip_forward_backward(log_prob, old_log_prob, advantages, mask):
    log_prob = log_prob.detach().requires_grad_()
    loss = aggregate_loss(clipped_surrogate(token_ratio(log_prob, old_log_prob), advantages, 0.8, 1.2), mask)
    loss.backward()


def policy_loss_forward_backward(log_prob, old_log_prob, advantages, mask):
    """The same fixed-clip loss as bapo's trainer calls it: with validation and every diagnostic."""
    log_prob = log_prob.detach().requires_grad_()
    loss, _ = policy_loss(log_prob, old_log_prob, advantages, mask, "grpo")
    loss.backward()


def peak_extra_bytes(tokens: int) -> int:
    """Peak RSS growth of one search, in a fresh process holding only its inputs: the kernel's
    high-water mark (VmHWM) is reset to the current RSS (/proc/self/clear_refs) right before the
    search, then read after it (ru_maxrss would not do: it survives fork and exec)."""
    root = str(Path(__file__).resolve().parents[1])
    code = (
        f"import re, torch, sys; sys.path.insert(0, {root!r})\n"
        "from bapo.core import TokenBatch\n"
        "from bench.bound_search import search\n"
        "kb = lambda key: int(re.search(key + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        f"ratio = torch.empty({tokens // 1024}, 1024).log_normal_(0.0, 0.3)\n"
        "advantages = torch.empty_like(ratio).normal_().sub_(0.35)\n"
        "mask = torch.empty_like(ratio, dtype=torch.bool).bernoulli_(0.9)\n"
        "search(TokenBatch(ratio=ratio[:2], advantages=advantages[:2], mask=mask[:2]))\n"  # load kernels first
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = kb('VmRSS')\n"
        "search(TokenBatch(ratio=ratio, advantages=advantages, mask=mask))\n"
        "print((kb('VmHWM') - before) * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 8_000_000])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the rows) and nothing else")
    args = parser.parse_args()
    header = (
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, candidates "
        f"{len(CONFIG.lower_grid)} lower x {len(CONFIG.upper_grid)} upper"
    )
    rows = []
    for tokens in args.tokens:
        log_prob, old_log_prob, advantages, mask = make_batch(tokens)
        batch = TokenBatch.from_log_probs(log_prob, old_log_prob, advantages, mask)
        found = search(batch)
        previous = search(batch, BucketizeStats)
        assert (previous.lower, previous.upper, previous.steps) == (found.lower, found.upper, found.steps)
        paper, recipe = BAPOConfig.paper(target=0.5, lower_step=0.05), BAPOConfig.recipe()
        times = interleaved_times(
            {
                "search": lambda: search(batch),
                "search_bucketize": lambda: search(batch, BucketizeStats),
                "search_paper": lambda: search(batch, config=paper),
                "search_recipe": lambda: search(batch, config=recipe),
                "loss": lambda: fixed_clip_forward_backward(log_prob, old_log_prob, advantages, mask),
                "policy_loss": lambda: policy_loss_forward_backward(log_prob, old_log_prob, advantages, mask),
            },
            args.repeats,
        )
        reference_s = best_time(lambda: per_candidate_loop(batch), 1)
        assert per_candidate_loop(batch) == (found.lower, found.upper)
        extra = peak_extra_bytes(tokens)
        loss_s = times["loss"]
        row = {
            "tokens": tokens,
            "candidates_moved": found.steps,
            "search_s": round(times["search"], 4),
            "search_bucketize_s": round(times["search_bucketize"], 4),
            "fixed_clip_fwd_bwd_s": round(loss_s, 4),
            "search_over_loss": round(times["search"] / loss_s, 3),
            "search_bucketize_over_loss": round(times["search_bucketize"] / loss_s, 3),
            "search_paper_over_loss": round(times["search_paper"] / loss_s, 3),
            "search_recipe_over_loss": round(times["search_recipe"] / loss_s, 3),
            "search_over_policy_loss_with_diagnostics": round(times["search"] / times["policy_loss"], 3),
            "per_candidate_loop_s": round(reference_s, 3),
            "speedup_vs_loop": round(reference_s / times["search"], 1),
            "peak_extra_bytes_per_token": round(extra / tokens, 1),
        }
        rows.append(row)
        if not args.json:
            print(json.dumps(row))
    if args.json:
        print(json.dumps({"machine": header, "rows": rows}))
        return
    print(header)
    print(
        "\n| tokens | moved | search s | fixed-clip fwd+bwd s | search/loss | bucketize search/loss | "
        "paper/loss | recipe/loss | search/policy_loss(grpo) | per-candidate loop s | speed-up | extra bytes/token |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']:,} | {r['candidates_moved']} | {r['search_s']} | {r['fixed_clip_fwd_bwd_s']} | "
            f"{r['search_over_loss']} | {r['search_bucketize_over_loss']} | {r['search_paper_over_loss']} | "
            f"{r['search_recipe_over_loss']} | {r['search_over_policy_loss_with_diagnostics']} | "
            f"{r['per_candidate_loop_s']} | {r['speedup_vs_loop']}x | {r['peak_extra_bytes_per_token']} |"
        )


if __name__ == "__main__":
    main()
