"""Benchmark of the one-pass BAPO bound search on CPU (not a test; prints ratios from one run).

    python bench/bound_search.py [--tokens 1000000 8000000] [--repeats 5]

Prints, per size: search time / fixed-clip loss forward+backward time (target <= 0.25 at 1M; both the bare
surrogate and bapo's policy_loss with its diagnostics are timed),
search time vs the candidate-by-candidate reference loop on a batch where the search moves
>= 10 candidates (target >= 5x faster), and the search's peak extra memory per token
(target: O(tokens + candidates), i.e. a constant number of bytes per token, far below the
8 bytes x candidates per token a [tokens x candidates] tensor would take).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.core.reference

from bapo.core import BAPOConfig, BoundStats, aggregate_loss, clipped_surrogate, policy_loss, token_ratio  # noqa: E402

CONFIG = BAPOConfig(target=0.5, lower_start=0.6, lower_max=0.9, lower_step=0.05,
                    upper_start=1.2, upper_max=3.0, upper_step=0.05)


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
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def search(ratio, advantages, mask):
    return BoundStats(CONFIG).add(ratio, advantages, mask).solve(sync=False)


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
    code = (
        "import re, torch, sys; sys.path.insert(0, %r)\n"
        "from bench.bound_search import search\n"
        "kb = lambda key: int(re.search(key + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "ratio = torch.empty(%d, 1024).log_normal_(0.0, 0.3)\n"
        "advantages = torch.empty_like(ratio).normal_().sub_(0.35)\n"
        "mask = torch.empty_like(ratio, dtype=torch.bool).bernoulli_(0.9)\n"
        "search(ratio[:2], advantages[:2], mask[:2])\n"  # load kernels before the baseline
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = kb('VmRSS')\n"
        "search(ratio, advantages, mask)\n"
        "print((kb('VmHWM') - before) * 1024)\n"
    ) % (str(Path(__file__).resolve().parents[1]), tokens // 1024)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from tests.core.reference import reference_search

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 8_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, candidates "
          f"{len(CONFIG.lower_grid)} lower x {len(CONFIG.upper_grid)} upper")
    rows = []
    for tokens in args.tokens:
        log_prob, old_log_prob, advantages, mask = make_batch(tokens)
        ratio = token_ratio(log_prob, old_log_prob)
        found = search(ratio, advantages, mask)
        search_s = best_time(lambda: search(ratio, advantages, mask), args.repeats)
        loss_s = best_time(lambda: fixed_clip_forward_backward(log_prob, old_log_prob, advantages, mask), args.repeats)
        full_loss_s = best_time(lambda: policy_loss_forward_backward(log_prob, old_log_prob, advantages, mask), args.repeats)
        reference_s = best_time(lambda: reference_search(ratio, advantages, mask, CONFIG), 1)
        assert reference_search(ratio, advantages, mask, CONFIG)[:2] == (found.lower, found.upper)
        extra = peak_extra_bytes(tokens)
        row = {
            "tokens": tokens, "candidates_moved": found.steps, "search_s": round(search_s, 4),
            "fixed_clip_fwd_bwd_s": round(loss_s, 4), "search_over_loss": round(search_s / loss_s, 3),
            "search_over_policy_loss_with_diagnostics": round(search_s / full_loss_s, 3),
            "reference_loop_s": round(reference_s, 3), "speedup_vs_reference": round(reference_s / search_s, 1),
            "peak_extra_bytes_per_token": round(extra / tokens, 1),
        }
        rows.append(row)
        print(json.dumps(row))
    print("\n| tokens | moved | search s | fixed-clip fwd+bwd s | search/loss | search/policy_loss(grpo) | "
          "reference loop s | speed-up | extra bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['candidates_moved']} | {r['search_s']} | {r['fixed_clip_fwd_bwd_s']} | "
              f"{r['search_over_loss']} | {r['search_over_policy_loss_with_diagnostics']} | {r['reference_loop_s']} | {r['speedup_vs_reference']}x | "
              f"{r['peak_extra_bytes_per_token']} |")


if __name__ == "__main__":
    main()
