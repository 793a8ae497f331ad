"""PreemptionGuard in one process: the first signal is kept for the step boundary, a second ends the
process as it would have without the guard. (Across ranks, train.py and the Trainer:
tests/test_train_script.py.)"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import os, signal, time
from ds_lowcomm.integration.preemption import PreemptionGuard
guard = PreemptionGuard()
assert guard.poll() == 0
os.kill(os.getpid(), signal.{sig})
time.sleep(0.2)
print(guard.poll(), guard.exit_code, guard.name, flush=True)
os.kill(os.getpid(), signal.{sig})
time.sleep(2)
print("still alive", flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_first_signal_waits_for_the_step_second_ends_the_process(sig):
    number = getattr(signal, sig)
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(sig=sig)], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == [str(int(number)), str(128 + number), sig], proc.stdout + proc.stderr
    assert proc.returncode == -number
