"""A 2-rank training where rank 1 dies (or stalls) at step 3; run by test_fault.py, a process per rank.

    python rank_dies.py COLLECTIVE_TIMEOUT_S {die,stall}
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import workers  # noqa: E402


def main():
    rank = int(os.environ["RANK"])
    engine = workers.build_engine(workers.config("zero1", collective_timeout_s=float(sys.argv[1])))
    gas = engine.gradient_accumulation_steps()
    for step in range(50):
        for micro in range(gas):
            if rank == 1 and step == 3 and micro == gas - 1:
                if sys.argv[2] == "stall":
                    time.sleep(3600)  # a hung GPU or a paused VM: alive, silent
                os._exit(3)  # no cleanup, no goodbye: like a lost node or an OOM kill
            x = workers.batch(step, micro, rank)
            engine.backward(engine(x, labels=x).loss)
            engine.step()
    print("finished all steps", flush=True)


if __name__ == "__main__":
    main()
