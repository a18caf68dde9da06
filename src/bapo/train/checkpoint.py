"""Atomic checkpoints: RUN_DIR/checkpoints/step_NNNNNN/{model/, state.pt} and a `latest` pointer.

A checkpoint is written into a temporary directory and renamed into place, then `latest` is
replaced (also by rename); a kill at any moment leaves the previous checkpoint intact.
state.pt holds everything else exact resume needs: optimizer, scheduler, RNG states, the
staleness FIFO / replay buffer, partial responses, data position, counters.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

LATEST = "latest"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, state: dict, keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    torch.save(state, tmp / "state.pt")
    if final.exists():  # the same step written again (after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names, else the newest complete step directory, else None."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.exists():
        named = root / pointer.read_text().strip()
        if (named / "state.pt").exists():
            return named
    complete = sorted(p for p in root.glob("step_*") if (p / "state.pt").exists())
    return complete[-1] if complete else None


def load_state(checkpoint: Path) -> dict:
    return torch.load(Path(checkpoint) / "state.pt", map_location="cpu", weights_only=False)
