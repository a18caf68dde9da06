"""Checkpoint save cost: the previous plain save (save_pretrained + torch.save + rename) next to
save_checkpoint (fsync of every file and directory + sha256 manifest), and verify_checkpoint, on the
demo model with an AdamW state. Interleaved in one run, so machine load hits both alike:

    PYTHONPATH=src OMP_NUM_THREADS=1 python bench/checkpoint_save.py [--repeats 8] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bapo.train.checkpoint import save_checkpoint, verify_checkpoint
from bapo.train.tiny import ModelConfig, build_model, build_tokenizer


def main(repeats: int = 8, as_json: bool = False) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(ModelConfig(), tokenizer)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    optimizer.step()
    state = {"optimizer": optimizer.state_dict(), "version": 1}
    root = Path(tempfile.mkdtemp())

    def plain_save(i: int) -> None:
        tmp = root / "plain" / f".tmp_{i}"
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        torch.save(state, tmp / "state.pt")
        os.replace(tmp, root / "plain" / f"step_{i}")

    times: dict[str, list[float]] = {"plain save": [], "manifest+fsync save": [], "verify": []}
    for i in range(repeats):
        start = time.perf_counter()
        plain_save(i)
        times["plain save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        path = save_checkpoint(root / "run", i, model, tokenizer, state, keep=2, save_optimizer="all")
        times["manifest+fsync save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        verify_checkpoint(path)
        times["verify"].append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    shutil.rmtree(root)
    medians_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if as_json:
        overhead = medians_ms["manifest+fsync save"] / medians_ms["plain save"]
        print(
            json.dumps(
                {"checkpoint_mb": size / 1e6, "repeats": repeats, "median_ms": medians_ms, "save_overhead": overhead}
            )
        )
        return
    print(
        f"checkpoint {size / 1e6:.1f} MB, medians of {repeats}: "
        + ", ".join(f"{name} {ms:.0f} ms" for name, ms in medians_ms.items())
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    args = parser.parse_args()
    main(args.repeats, args.json)
