"""examples/train.py as users run it: torchrun or the deepspeed launcher, both --deepspeed forms."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "train.py")
SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--eval-iters", "2", "--log-every", "2"]
ENV = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def torchrun(*args, launcher=None):
    cmd = launcher or [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                       "--master_port", str(__import__("dist").free_port())]
    proc = subprocess.run([*cmd, SCRIPT, *SMALL, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # The script's last line is the JSON result; the deepspeed launcher prints its own exit lines
    # after it, so take the script's last line (one starting with "{").
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    if launcher is None:
        return json.loads(lines[-1]), proc.stdout
    return json.loads([l for l in lines if l.startswith("{")][-1]), proc.stdout


def test_train_save_resume_and_report(tmp_path):
    """Six steps straight, against four, a save and two more (dropout on: its masks must be the
    same after the restart, which no checkpoint keeps). The restarted run's --log-json goes on from
    the clock and tokens the checkpoint keeps."""
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_bytes(workers.corpus()[:200_000])
    ckpt = str(tmp_path / "ckpt")
    per_step = 8 * 4 * 2 * 32  # tokens: micro-batch x accumulation (zero1.json) x ranks x block
    straight, log = torchrun("--deepspeed", "ds_configs/zero1.json", "--max-steps", "6",
                             "--eval-every", "3", "--data", str(data), "--dropout", "0.2",
                             "--log-json", str(tmp_path / "straight.jsonl"))
    for key in ("final_train_loss", "val_loss", "tokens", "steps", "tokens_per_s",
                "bytes_sent_per_rank_per_step", "mode"):
        assert key in straight
    assert straight["mode"] == "zero1" and straight["steps"] == 6
    assert straight["tokens"] == 6 * per_step
    assert straight["bytes_sent_per_rank_per_step"] > 0
    assert "step 4/6 | loss" in log and "tok/s" in log and "MB/step" in log and "val loss" in log
    assert "before it has started" not in log  # DeepSpeed's per-rank scheduler warning, silenced

    # One command line for the first start and the restart: --resume auto.
    _, first = torchrun("--deepspeed", "ds_configs/zero1.json", "--max-steps", "4", "--data", str(data),
                        "--save-dir", ckpt, "--resume", "auto", "--dropout", "0.2",
                        "--log-json", str(tmp_path / "resumed.jsonl"))
    assert f"--resume auto: no checkpoint in {ckpt} yet; starting fresh" in first
    resumed, log = torchrun("--deepspeed", "ds_configs/zero1.json", "--max-steps", "6", "--data", str(data),
                            "--save-dir", ckpt, "--resume", "auto", "--dropout", "0.2",
                            "--log-json", str(tmp_path / "resumed.jsonl"))
    assert "resumed from" in log
    assert resumed["final_train_loss"] == straight["final_train_loss"]
    assert resumed["val_loss"] == straight["val_loss"]
    records = {name: [json.loads(l) for l in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
               for name in ("straight", "resumed")}
    # the first process logs steps 2 and 4 and validates at 4; the second logs 6 and validates
    assert [r["step"] for r in records["resumed"]] == [2, 4, 4, 6, 6], records["resumed"]
    train = {name: {r["step"]: r for r in rs if "loss" in r} for name, rs in records.items()}
    for step in (2, 4, 6):
        assert train["resumed"][step]["loss"] == train["straight"][step]["loss"]
        assert train["resumed"][step]["tokens"] == train["straight"][step]["tokens"] == step * per_step
    # Each checkpoint keeps the run's clock and tokens at its save; the second process's clock goes
    # on from the first's by its own two steps.
    saved = {step: torch.load(Path(ckpt) / f"global_step{step}" / "mp_rank_00_model_states.pt", weights_only=True)
             for step in (4, 6)}
    clock = [r["train_s"] for r in records["resumed"]]
    assert saved[4]["train_s"] == clock[1] == clock[2] and saved[6]["train_s"] == clock[3] == clock[4], clock
    assert clock[3] - clock[2] == pytest.approx(2 * resumed["step_time_s"]), (clock, resumed["step_time_s"])
    assert (saved[4]["tokens"], saved[6]["tokens"], resumed["tokens"]) == (4 * per_step, 6 * per_step, 6 * per_step)


def test_a_damaged_checkpoint_ends_every_rank_cleanly(tmp_path):
    """--resume from a checkpoint whose rank file changed: the run ends with exit code 1 and one
    line naming the file, no rank aborted in a destructor (gloo's "terminate called ...", SIGABRT),
    over three tries. (torchrun stops the other rank once one has exited: it may not print.)"""
    ckpt = tmp_path / "ckpt"
    torchrun("--deepspeed", "zero1", "--max-steps", "2", "--eval-every", "0", "--save-dir", str(ckpt))
    (rank_file,) = ckpt.glob("*/lowcomm_rank00001.pt")
    data = bytearray(rank_file.read_bytes())
    data[-100] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(__import__("dist").free_port()), SCRIPT, *SMALL, "--deepspeed",
                               "zero1", "--max-steps", "4", "--save-dir", str(ckpt), "--resume"],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        errors = [l for l in proc.stderr.splitlines() if l.startswith("error: --resume:")]
        assert proc.returncode != 0 and errors, proc.stderr[-3000:]
        assert all("lowcomm_rank00001.pt" in e and "does not match the sha256" in e for e in errors), errors
        assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr[-3000:]
        assert "Root Cause" in proc.stderr and proc.stderr.split("Root Cause")[1].count("exitcode  : 1 ") == 1


def _signal_workers(cmd, sig: str, ready) -> str:
    """Start ``cmd`` (torchrun, 2 workers), wait for the stdout line ``ready(line)`` accepts, send
    ``sig`` to each worker a moment apart (as a scheduler's notices arrive), return stderr."""
    import signal
    import time

    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if ready(line):
                break
        pids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(pids) == 2, pids
        for i, pid in enumerate(pids):
            os.kill(int(pid), getattr(signal, sig))
            time.sleep(0.05 * i)
        return proc.communicate(timeout=120)[1]
    finally:
        proc.kill()


def _train_cmd(ckpt, config="zero1"):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(__import__("dist").free_port()), SCRIPT, *SMALL, "--deepspeed", config,
            "--max-steps", "400", "--eval-every", "0", "--log-every", "1", "--save-dir", str(ckpt)]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_saves_the_step_in_progress(tmp_path, sig):
    """SIGTERM or SIGUSR1 to the workers mid-run, as a scheduler sends them (at different moments
    on each rank): every rank stops after the same step, that step is saved (no periodic saves
    here), the exit code is 128 + the signal's number, and --resume goes on from that step."""
    import signal

    ckpt = tmp_path / "ckpt"
    err = _signal_workers(_train_cmd(ckpt), sig, lambda line: line.startswith("step 5/400"))
    number = getattr(signal, sig)
    stopped = [l for l in err.splitlines() if l.startswith(f"{sig}: stopped after step")]
    assert len(stopped) == 1, err[-3000:]
    step = int(stopped[0].split("step ")[1].split(";")[0])
    assert f"saved step {step} to {ckpt}" in stopped[0] and f"exit code {128 + number}" in stopped[0]
    assert 5 <= step < 400 and (ckpt / "latest").read_text().strip() == f"global_step{step}"
    assert f"exitcode  : {128 + number}" in err and "terminate called" not in err
    resumed, log = torchrun("--deepspeed", "zero1", "--max-steps", str(step + 2), "--eval-every", "0",
                            "--save-dir", str(ckpt), "--resume")
    assert f"resumed from {ckpt} at step {step}" in log and resumed["steps"] == step + 2


def test_save_on_preemption_false_leaves_the_signal_its_default(tmp_path):
    """``"save_on_preemption": false``: SIGTERM ends the workers at once, as stock DeepSpeed's;
    nothing is saved."""
    cfg = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    cfg["lowcomm"]["save_on_preemption"] = False
    (tmp_path / "off.json").write_text(json.dumps(cfg))
    ckpt = tmp_path / "ckpt"
    err = _signal_workers(_train_cmd(ckpt, str(tmp_path / "off.json")), "SIGTERM",
                          lambda line: line.startswith("step 5/400"))
    assert "stopped after step" not in err and "Signal 15 (SIGTERM) received" in err, err[-3000:]
    assert not (ckpt / "latest").exists()


def test_a_preemption_signal_under_the_trainer_saves_its_checkpoint(tmp_path):
    """SIGTERM to the Trainer's workers (finetune_hf.py, a plain Trainer script): the Trainer saves
    its own checkpoint-N of the step every rank stopped after, the workers exit 143, and
    resume_from_checkpoint (--resume) goes on from that step."""
    out = tmp_path / "run"
    tiny = ["--micro-batch", "2", "--gas", "2", "--block-size", "32", "--n-layer", "1", "--n-head", "2",
            "--n-embd", "32", "--eval-iters", "1", "--output-dir", str(out), "--deepspeed",
            str(ROOT / "ds_configs" / "hf" / "zero1.json")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(__import__("dist").free_port()), str(ROOT / "examples" / "finetune_hf.py")]
    logged = []
    err = _signal_workers([*cmd, *tiny, "--max-steps", "20000", "--log-every", "1"], "SIGTERM",
                          lambda line: logged.append("'loss'" in line) or sum(logged) == 5)
    stopped = [l for l in err.splitlines() if l.startswith("SIGTERM: stopped after step")]
    assert len(stopped) == 1, err[-3000:]
    step = int(stopped[0].split("step ")[1].split(";")[0])
    assert f"saved {out / f'checkpoint-{step}'}; exit code 143" in stopped[0]
    assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file() and step >= 5
    assert "exitcode  : 143" in err and "terminate called" not in err
    proc = subprocess.run([*cmd, *tiny, "--max-steps", str(step + 2), "--resume"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == step + 2


def test_finetune_hf_resume_spellings(tmp_path, capsys):
    """finetune_hf.py's --resume as train.py's: bare, the newest checkpoint or a one-line error;
    'auto', the newest or a fresh start; else a checkpoint directory."""
    sys.path.insert(0, str(ROOT / "examples"))
    import finetune_hf

    out = tmp_path / "run"
    assert finetune_hf.parse_args(["--resume"]).resume == "latest"
    assert finetune_hf.parse_args(["--resume", "auto"]).resume == "auto"
    assert finetune_hf.resume_point("auto", str(out)) is None
    assert "--resume auto: no checkpoint in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="^error: --resume: no checkpoint-N in"):
        finetune_hf.resume_point("latest", str(out))
    for step in (5, 10, 9):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    for spelling in ("latest", "auto"):
        assert finetune_hf.resume_point(spelling, str(out)) == str(out / "checkpoint-10")
    assert finetune_hf.resume_point(str(out / "checkpoint-5"), str(out)) == str(out / "checkpoint-5")


def test_stock_deepspeed_with_deepspeed_launcher_and_flag_form():
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2",
                "--master_port", str(__import__("dist").free_port())]
    result, _ = torchrun("--deepspeed", "--deepspeed_config", "ds_configs/deepspeed_zero1.json",
                         "--max-steps", "2", "--eval-every", "0", launcher=launcher)
    assert result["mode"] == "deepspeed" and math.isfinite(result["val_loss"])


@pytest.mark.parametrize("argv,expected", [
    (["--deepspeed", "cfg.json"], "cfg.json"),
    (["--deepspeed", "--deepspeed_config", "cfg.json"], "cfg.json"),
    (["--deepspeed_config", "cfg.json"], "cfg.json"),
])
def test_deepspeed_argument_forms(argv, expected):
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    assert train.parse_args(argv).deepspeed == expected


def test_bad_config_is_one_line_error(tmp_path):
    cfg = workers.config("zero1")
    cfg["lowcomm"]["shard_group_size"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, SCRIPT, "--deepspeed", str(path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {path}: lowcomm.shard_group_size: got 0; must be >= 1")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("script,argv,message", [
    ("train", ["--log-every", "0"], "argument --log-every: got 0; must be >= 1"),
    ("train", ["--eval-iters", "0"], "argument --eval-iters: got 0; must be >= 1"),
    ("train", ["--max-steps", "0"], "argument --max-steps: got 0; must be >= 1"),
    ("train", ["--max-steps", "ten"], "argument --max-steps: 'ten': expected an integer, e.g. 1"),
    ("train", ["--val-fraction", "0"], "argument --val-fraction: got 0; must be between 0 and 1 (exclusive)"),
    ("train", ["--save-every", "-1"], "argument --save-every: got -1; must be >= 0"),
    ("train", ["--n-embd", "30", "--n-head", "4"], "--n-embd 30 must be a multiple of --n-head 4"),
    ("train", ["--dropout", "1"], "--dropout: got 1; must be in [0, 1)"),
    ("finetune_hf", ["--gas", "0"], "argument --gas: got 0; must be >= 1"),
    ("finetune_hf", ["--max-steps", "0"], "argument --max-steps: got 0; must be >= 1"),
    ("finetune_hf", ["--lr", "-1"], "argument --lr: got -1; must be >= 0"),
    ("finetune_hf", ["--micro-batch", "two"], "argument --micro-batch: 'two': expected an integer, e.g. 1"),
    ("finetune_hf", ["--slow-ranks", "1:0.5"], "argument --slow-ranks: '1:0.5': FACTOR must be >= 1"),
])
def test_bad_arguments_are_one_line_errors(capsys, script, argv, message):
    sys.path.insert(0, str(ROOT / "examples"))
    module = __import__(script)

    with pytest.raises(SystemExit) as info:
        module.parse_args(["--deepspeed", "cfg.json", *argv])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_slow_ranks_outside_the_launch_are_refused():
    sys.path.insert(0, str(ROOT / "examples"))
    import common

    assert common.slow_factor({1: 3.0}, 1, 2) == 3.0 and common.slow_factor({1: 3.0}, 0, 2) == 1.0
    with pytest.raises(SystemExit) as info:  # (it used to be ignored)
        common.slow_factor({5: 3.0}, 0, 2)
    assert str(info.value) == "error: --slow-ranks names rank 5, but this launch has ranks 0-1"


@pytest.mark.parametrize("text,flags,message", [
    ("", [], "the file is empty"),
    ("x" * 1000, [], "the validation part of the corpus has 100 tokens, too few for --block-size 128"),
    ("x" * 1000, ["--val-fraction", "0.95"], "the training part of the corpus has 50 tokens"),
])
def test_bad_data_is_a_one_line_error(tmp_path, text, flags, message):
    sys.path.insert(0, str(ROOT / "examples"))
    import train

    data = tmp_path / "data.txt"
    data.write_text(text)
    with pytest.raises(SystemExit) as info:
        train.main(["--deepspeed", "cfg.json", "--data", str(data), *flags])
    assert message in str(info.value) and "\n" not in str(info.value), info.value


DDP_SCRIPT = str(ROOT / "examples" / "train_ddp.py")


def _run_logged(script, tmp_path, name, *args):
    log = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(__import__("dist").free_port()), script, *SMALL,
           "--deepspeed", "ds_configs/deepspeed_zero1.json", "--max-steps", "4", "--eval-every", "2",
           "--log-every", "1", "--log-json", str(log), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(l) for l in log.read_text().splitlines()]
    return json.loads(proc.stdout.splitlines()[-1]), records


def test_ddp_peer_trains_like_stock_deepspeed(tmp_path):
    """The bench's DDP peer is train.py's training with DDP's all-reduce: the same losses as stock
    DeepSpeed ZeRO-1 on the same model, data, schedule and clipping; PowerSGD departs from them
    only once its plain all-reduce warm-up is over."""
    stock, stock_rec = _run_logged(SCRIPT, tmp_path, "stock")
    ddp, ddp_rec = _run_logged(DDP_SCRIPT, tmp_path, "ddp")
    psgd, psgd_rec = _run_logged(DDP_SCRIPT, tmp_path, "psgd", "--powersgd-rank", "1", "--powersgd-warmup", "2")
    assert (stock["mode"], ddp["mode"], psgd["mode"]) == ("deepspeed", "ddp", "ddp-powersgd")
    losses = lambda recs: [r["loss"] for r in recs if "loss" in r]
    vals = lambda recs: [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    assert len(losses(ddp_rec)) == 4
    assert losses(ddp_rec) == pytest.approx(losses(stock_rec), rel=1e-5, abs=1e-6)
    assert [s for s, _ in vals(ddp_rec)] == [2, 4]  # validation at fixed steps, end included
    assert [v for _, v in vals(ddp_rec)] == pytest.approx([v for _, v in vals(stock_rec)], rel=1e-5)
    assert ddp["tokens"] == stock["tokens"] and ddp["val_loss"] == pytest.approx(stock["val_loss"], rel=1e-5)
    # Records carry the training clock (validation excluded): non-decreasing.
    clock = [r["train_s"] for r in ddp_rec]
    assert clock == sorted(clock)
    # PowerSGD: the two warm-up steps all-reduce exactly, then compression changes the update.
    assert losses(psgd_rec)[:3] == pytest.approx(losses(ddp_rec)[:3], rel=1e-5, abs=1e-6)
    assert abs(psgd["val_loss"] - ddp["val_loss"]) > 1e-6 and math.isfinite(psgd["val_loss"])


def _files_on_the_way_to_the_wire(rank, world):
    """examples/train.py's ``main`` in this process, the shard group's reduce-scatter recording
    the project files on the call stack each time it is issued."""
    import traceback

    sys.path.insert(0, str(ROOT / "examples"))
    import train
    import ds_lowcomm
    from ds_lowcomm.comm.collectives import Collectives

    package = os.path.dirname(os.path.dirname(os.path.abspath(ds_lowcomm.__file__)))
    ours = {str(ROOT / "examples"): str(ROOT), os.path.join(package, "ds_lowcomm"): package}
    stacks, issue = [], Collectives.reduce_scatter

    def recording(self, *args, **kwargs):
        files = set()
        for frame in traceback.extract_stack()[:-1]:
            for top, base in ours.items():
                if frame.filename.startswith(top + os.sep):
                    files.add(os.path.relpath(frame.filename, base))
        stacks.append(sorted(files | {"ds_lowcomm/comm/collectives.py"}))  # where the wire is
        return issue(self, *args, **kwargs)

    Collectives.reduce_scatter = recording
    train.main(["--deepspeed", str(ROOT / "ds_configs" / "zero1.json"), *SMALL, "--max-steps", "2"])
    return stacks


def test_a_zero1_step_reaches_the_wire_through_six_files():
    """From examples/train.py to the gradient's reduce-scatter, a zero1 step's call stack holds at
    most six project files (today five: the script, the optimizer, the mode, the sharded step and
    the collectives; DeepSpeed's engine calls the optimizer), and no comm worker: a synchronous
    mode's round is run on the training thread by ``step_now``."""
    for stacks in run_ranks(_files_on_the_way_to_the_wire, 2):
        assert len(stacks) == 2  # one reduce-scatter per step
        for files in stacks:
            assert "examples/train.py" in files and len(files) <= 6, files
            assert "ds_lowcomm/comm/worker.py" not in files, files  # a synchronous round runs inline
