"""BAPOGRPOTrainer on 2 CPU processes (accelerate launch, gloo) against 1 process on the same
global batch: identical bounds on every rank at every step, the same loss and the same weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integrations" / "trl_two_process.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command: list[str], out: Path) -> dict[int, dict]:
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])  # the repository root: examples.trl, tests.helpers
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from examples.trl.tiny_task import build_tiny_model

    root = tmp_path_factory.mktemp("trl-distributed")
    model = build_tiny_model(root / "model")
    single = run([sys.executable, str(SCRIPT), str(model), str(root / "one")], root / "one")
    # --multi_gpu, not --cpu: without GPUs it starts 2 torchrun processes that TRL's use_cpu=True makes
    # gloo ranks; accelerate's --cpu launcher would start a single process (it needs MPI for more)
    double = run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            str(SCRIPT),
            str(model),
            str(root / "two"),
        ],
        root / "two",
    )
    return single, double


def test_two_processes_really_ran(runs):
    single, double = runs
    assert set(single) == {0} and single[0]["world"] == 1
    assert set(double) == {0, 1} and double[0]["world"] == double[1]["world"] == 2


def test_every_rank_uses_identical_bounds_every_step(runs):
    _, double = runs
    for mode in ("fixed", "train"):
        ranks = [[(s["lower"], s["upper"]) for s in double[rank][mode]] for rank in (0, 1)]
        assert len(ranks[0]) == 2 and ranks[0] == ranks[1], (mode, ranks)
    assert [s["step"] for s in double[0]["train"]] == [1, 2]


def test_two_processes_equal_one_process_on_the_same_global_batch(runs):
    single, double = runs
    one, two = single[0]["fixed"], double[0]["fixed"]
    assert any((s["lower"], s["upper"]) != (0.6, 1.2) for s in one)  # the search moved: the comparison means something
    for a, b, c in zip(one, two, double[1]["fixed"]):
        assert (a["lower"], a["upper"]) == (b["lower"], b["upper"])
        assert a["positive_share"] == pytest.approx(b["positive_share"], rel=1e-6)
        # the logged diagnostics are over both ranks' tokens, the same on every rank
        assert a["logged_positive_share"] == pytest.approx(b["logged_positive_share"], rel=1e-6)
        assert a["logged_tokens"] == b["logged_tokens"] == c["logged_tokens"]
        assert b["logged_positive_share"] == c["logged_positive_share"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["param_sum"] == pytest.approx(b["param_sum"], rel=1e-6)
        assert a["param_abs_sum"] == pytest.approx(b["param_abs_sum"], rel=1e-6)
        assert a["param_head"] == pytest.approx(b["param_head"], abs=1e-6)
        assert b["param_head"] == c["param_head"]  # DDP keeps the replicas identical
    assert one[0]["param_head"] != one[1]["param_head"]  # the steps changed the weights
