"""SIGINT / SIGTERM: the first finishes the step, checkpoints and exits 130 / 143 with a resume
hint; the second aborts at once; handlers exist only while train() runs, and a signal the process
was started with ignored stays ignored. The tests set the dispositions they need, so the suite passes
whatever the shell hands it (`make test &` starts pytest with SIGINT ignored)."""

import os
import signal

import pytest

from bapo.train import read_metrics, train
from bapo.train.checkpoint import checkpoints, latest_checkpoint
from bapo.train.trainer import TrainingAborted, TrainingInterrupted
from tests.helpers import arithmetic_examples, digit_share, make_config
from tests.train.test_resume import strip_timing

DATA = {"examples": arithmetic_examples(), "verifier": digit_share}


@pytest.fixture
def interactive_signals():
    """SIGINT and SIGTERM as an interactive terminal starts them (Python's defaults), restored after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def send_at(at_update: int, *signals):
    def on_update(update, model, tokenizer):
        if update == at_update:
            for signum in signals:
                os.kill(os.getpid(), signum)

    return on_update


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_first_signal_checkpoints_and_resume_is_exact(tiny_model, tmp_path, sig, code, interactive_signals):
    before = signal.getsignal(sig)
    straight = make_config(tiny_model, tmp_path / "straight", **{"run.rollout_steps": 4, "offpolicy.async_delay": 1})
    rows_straight = read_metrics(train(straight, **DATA))

    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 4, "offpolicy.async_delay": 1})
    with pytest.raises(
        TrainingInterrupted,
        match=r"interrupted after update 2; resume with: "
        rf"bapo train --resume {tmp_path / 'run'}",
    ) as err:
        train(cfg, on_update=send_at(2, sig), **DATA)
    assert err.value.exit_code == code
    assert signal.getsignal(sig) is before  # restored after train()
    assert latest_checkpoint(tmp_path / "run").name == "update_000002"
    rows = read_metrics(train(cfg, resume=tmp_path / "run", **DATA))
    assert strip_timing(rows) == strip_timing(rows_straight)


def test_second_signal_aborts_at_once_and_keeps_the_last_checkpoint(tiny_model, tmp_path, interactive_signals):
    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 4, "run.checkpoint_every": 1})
    with pytest.raises(TrainingAborted) as err:
        train(cfg, on_update=send_at(2, signal.SIGINT, signal.SIGINT), **DATA)
    assert err.value.exit_code == 130
    # aborted inside update 2's hook: no checkpoint 2, checkpoint 1 intact, nothing half-written
    assert [c.name for c in checkpoints(tmp_path / "run")] == ["update_000001"]
    assert latest_checkpoint(tmp_path / "run").name == "update_000001"
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp_*"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored to what it was before


def test_started_with_sigint_ignored_keeps_it_ignored_and_still_saves_on_sigterm(
    tiny_model, tmp_path, interactive_signals
):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what `bapo train ... &` from a script hands the process
    seen_during = {}

    def on_update(update, model, tokenizer):
        if update == 2:
            seen_during["SIGINT"] = signal.getsignal(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # ignored: training goes on
            os.kill(os.getpid(), signal.SIGTERM)  # handled: finish the step, checkpoint, exit 143

    cfg = make_config(tiny_model, tmp_path / "run", **{"run.rollout_steps": 4, "offpolicy.async_delay": 1})
    with pytest.raises(TrainingInterrupted) as err:
        train(cfg, on_update=on_update, **DATA)
    assert seen_during["SIGINT"] is signal.SIG_IGN
    assert err.value.exit_code == 143
    assert latest_checkpoint(tmp_path / "run").name == "update_000002"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
