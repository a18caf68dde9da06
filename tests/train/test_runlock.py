"""One writer per run directory: an flock on RUN_DIR/.lock, released by the kernel on death."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bapo.train import ConfigError, Trainer, train
from bapo.train.rundir import RunLock
from tests.helpers import arithmetic_examples, digit_share, make_config

DATA = {"examples": arithmetic_examples(), "verifier": digit_share}

HOLD = """
import sys, time
from pathlib import Path
from bapo.train.rundir import RunLock
lock = RunLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""


def test_second_writer_fails_at_once_naming_the_holder(tiny_model, tmp_path):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 1})
    first = Trainer(cfg, **DATA)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"in use by another bapo process \(pid {os.getpid()}\)"):
        Trainer(cfg.model_copy(update={"run": cfg.run.model_copy(update={"overwrite": True})}), **DATA)
    assert time.perf_counter() - start < 5
    first.fit()  # the first writer is undisturbed and releases the lock at the end
    train(cfg, resume=tmp_path / "run", **DATA)


def test_lock_of_a_killed_process_never_blocks(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = make_config(tiny_model, run_dir, **{"run.rollout_steps": 1})
        with pytest.raises(ConfigError, match=rf"pid {holder.pid}\)"):
            Trainer(cfg, **DATA)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run_dir / ".lock").exists()  # the file stays; the kernel dropped the lock
    lock = RunLock(run_dir)
    lock.release()
    train(make_config(tiny_model, run_dir, **{"run.rollout_steps": 1}), **DATA)
