"""The BAPO step's checkpoint file, one format for TRL and verl: `bapo.core.BAPOStep.state_dict()`
as JSON, one file per rank (`bapo_step_rank<r>.json`) next to the framework's own checkpoint.
(bapo.train keeps the same dict inside its trainer state.)"""

from __future__ import annotations

import json
import os

STATE_FILE = "bapo_step_rank{rank}.json"


def step_state_path(folder: str, rank: int) -> str:
    """Where rank `rank` keeps its BAPO step state in checkpoint directory `folder`."""
    return os.path.join(folder, STATE_FILE.format(rank=rank))


def save_step_state(folder: str, rank: int, state: dict) -> None:
    """Write `state` (BAPOStep.state_dict()) atomically: a kill mid-write leaves the previous file whole."""
    path = step_state_path(folder, rank)
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as file:
        json.dump(state, file)
    os.replace(path + ".tmp", path)


def load_step_state(folder: str, rank: int) -> dict | None:
    """The saved state, or None when the checkpoint has none (BAPOStep.load_state_dict(None)
    then warns and starts afresh)."""
    path = step_state_path(folder, rank)
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)
