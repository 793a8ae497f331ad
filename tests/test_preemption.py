"""PreemptionGuard in one process: the first signal is kept for the step boundary, a second ends the
process as it would have without the guard; one caught after the last poll is reported at close,
which gives the handlers back. (Across ranks, train.py and the Trainer:
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


CLOSE_SCRIPT = """
import os, signal, time
from ds_lowcomm.integration.preemption import PreemptionGuard
guard = PreemptionGuard()
assert guard.poll() == 0
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
if {acted_on}:
    assert guard.poll() == signal.SIGTERM  # the loop saw it: saved and stopping
print("caught", flush=True)
guard.close()
guard.close()
print("closed", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


@pytest.mark.parametrize("acted_on", [False, True], ids=["after-the-last-poll", "acted-on"])
def test_close_reports_a_signal_too_late_to_act_on_and_gives_the_handlers_back(acted_on):
    """A SIGTERM after the last poll (the end of training) is not acted on: close says so in one
    line, the process goes on (to the script's final save) and the default handler is back; one
    the loop acted on is not reported again."""
    proc = subprocess.run([sys.executable, "-c", CLOSE_SCRIPT.format(acted_on=acted_on)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["caught", "closed", "True"], proc.stdout + proc.stderr
    late = [line for line in proc.stderr.splitlines() if "came in the last step" in line]
    assert late == ([] if acted_on else [
        "ds_lowcomm: SIGTERM came in the last step, too late for the ranks' last check; training has "
        "finished, so it is not acted on (a new signal has its usual effect)"]), proc.stderr
