"""Checkpoints that prove themselves: RUN_DIR/checkpoints/update_NNNNNN/{model/, state.pt, manifest.json},
NNNNNN the optimizer updates done (the policy version it holds).

A checkpoint is written into `.tmp_update_NNNNNN_<pid>/`, every file is fsync'ed, then
`manifest.json` (size and sha256 of every other file) is written last, the directory is fsync'ed
and renamed into place, and the parent directory is fsync'ed; a kill or power loss at any moment
leaves the previous checkpoints intact. `verify_checkpoint` re-hashes a checkpoint against its
manifest; resume (bapo.train.trainer) takes the newest checkpoint that verifies and loads.
state.pt holds everything else exact resume needs: optimizer, scheduler, RNG states, the
async-delay FIFO / replay buffer, partial responses, data position, counters.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from bapo.train.lora import ADAPTER_DIR, merged_weights, save_adapter

LATEST = "latest"
MANIFEST = "manifest.json"
PREFIX = "update_"  # + optimizer updates done, 6 digits
# the folder name of checkpoints written before it said what it counts: read by _updates_done only
OLD_PREFIX = "step_"
TMP_PREFIX = ".tmp_"
CORRUPT_PREFIX = "corrupt_"  # checkpoints that failed to verify are renamed, never deleted


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. disk full); the message names the last good one."""


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames and new entries durable)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file() and path.name != MANIFEST)


def _write_manifest(directory: Path) -> None:
    """fsync every file, then write manifest.json (relative path -> size, sha256) last."""
    entries = {}
    for path in _files(directory):
        _fsync_path(path)
        entries[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = directory / MANIFEST
    with open(manifest, "w") as file:
        json.dump({"format": 1, "files": entries}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    for folder in sorted({path.parent for path in _files(directory)} | {directory}):
        _fsync_path(folder)


def verify_checkpoint(checkpoint: Path) -> str | None:
    """None when every file matches the manifest; else why not, naming the file."""
    checkpoint = Path(checkpoint)
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        entries = manifest["files"]
    except FileNotFoundError:
        return f"{checkpoint / MANIFEST}: missing (the save did not finish, or an older bapo wrote it)"
    except (ValueError, KeyError, TypeError) as err:
        return f"{checkpoint / MANIFEST}: unreadable ({err})"
    for required in ("state.pt", "model/config.json"):
        if required not in entries:
            return f"{checkpoint / required}: not in the manifest"
    for name, entry in entries.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path}: missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path}: {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
        if _sha256(path) != entry["sha256"]:
            return f"{path}: sha256 differs from the manifest (corrupted)"
    return None


def _updates_done(path: Path) -> int | None:
    """The optimizer updates a checkpoint folder's name counts (update_NNNNNN, or an older run's
    step_NNNNNN, which counted the same); None for any other name."""
    for prefix in (PREFIX, OLD_PREFIX):
        digits = path.name.removeprefix(prefix)
        if digits != path.name and digits.isdigit():
            return int(digits)
    return None


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories of a run, newest (most updates) first (not yet verified)."""
    root = Path(run_dir) / "checkpoints"
    found = [path for path in root.glob("*") if path.is_dir() and _updates_done(path) is not None]
    return sorted(found, key=_updates_done, reverse=True)


def remove_stale_tmp(run_dir: Path) -> list[Path]:
    """Delete half-written `.tmp_*` directories (a kill, Ctrl-C or failed save); call it only
    while holding the run lock, so that no other writer's save is in progress."""
    root = Path(run_dir) / "checkpoints"
    stale = sorted(root.glob(TMP_PREFIX + "*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def quarantine(checkpoint: Path) -> Path:
    """Rename a checkpoint that failed to verify out of the resume candidates (kept for inspection)."""
    target = checkpoint.with_name(CORRUPT_PREFIX + checkpoint.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(checkpoint, target)
    return target


def save_checkpoint(
    run_dir: Path,
    updates: int,
    model,
    tokenizer,
    state: dict,
    keep: int,
    save_optimizer: str = "latest",
    adapter=None,
) -> Path:
    """Write the checkpoint after `updates` optimizer updates atomically; prune to the newest `keep`.

    save_optimizer: "all" keeps the optimizer state in every checkpoint, "latest" strips it from
    the older ones when a newer one is written (they stay loadable, model-only), "none" never
    writes it (such checkpoints are model-only: resume refuses them unless asked, see trainer).
    adapter: the PeftModel of a LoRA run (model.lora): `model/` then holds the merged weights (what
    `bapo eval` and HF tools load) and `adapter/` the adapter alone (what resume loads onto the base).
    Raises CheckpointError naming the last good checkpoint when the write fails (disk full ...);
    the partial directory is removed and the older checkpoints are untouched.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{updates:06d}"
    tmp = root / f"{TMP_PREFIX}{PREFIX}{updates:06d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if save_optimizer == "none":
        state = {**state, "optimizer": None}
    try:
        if adapter is None:
            model.save_pretrained(tmp / "model", safe_serialization=True)
        else:
            model.save_pretrained(tmp / "model", state_dict=merged_weights(model), safe_serialization=True)
            save_adapter(adapter, tmp / ADAPTER_DIR)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(state, tmp / "state.pt")
        _write_manifest(tmp)
        if final.exists():  # the same update written again (after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_path(root)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
        _fsync_path(root)
    except BaseException as err:  # also a second Ctrl-C: never leave a half-written directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, Exception):
            raise
        good = next((older.name for older in checkpoints(run_dir) if older != final), None)
        # torch.save reports a full disk as "basic_ios::clear: iostream error", without an errno
        disk_full = getattr(err, "errno", None) == errno.ENOSPC or "iostream error" in str(err)
        why = "no space left on device" if disk_full else f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"{why} while writing checkpoint {updates} ({final}); the last good checkpoint is {good or 'none'}"
        ) from err
    for old in checkpoints(run_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    if save_optimizer == "latest":
        for older in checkpoints(run_dir)[1:]:
            _strip_optimizer(older)
    return final


def _strip_optimizer(checkpoint: Path) -> None:
    """Rewrite an older checkpoint's state.pt without the optimizer (and re-manifest it), through a
    temporary file and a rename, so a kill leaves either the full or the stripped version."""
    state = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=False)
    if state.get("optimizer") is None:
        return
    state["optimizer"] = None
    tmp = checkpoint / "state.pt.tmp"
    torch.save(state, tmp)
    _fsync_path(tmp)
    # manifest first would name a state.pt not yet there; the rename then the manifest: a kill in
    # between leaves a checkpoint that fails to verify and is skipped, never a wrong one loaded
    os.replace(tmp, checkpoint / "state.pt")
    _write_manifest(checkpoint)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies against its manifest, else None."""
    return next((checkpoint for checkpoint in checkpoints(run_dir) if verify_checkpoint(checkpoint) is None), None)


def load_state(checkpoint: Path) -> dict:
    state = torch.load(Path(checkpoint) / "state.pt", map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "version" not in state:
        raise ValueError(f"{Path(checkpoint) / 'state.pt'}: not a bapo training state")
    return state
