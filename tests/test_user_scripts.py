"""The zero-code promise, tested the way users run it.

Three ordinary scripts that never name ds_lowcomm (``tests/user_scripts``: a Trainer script like
transformers' run_clm.py, an accelerate script like run_clm_no_trainer.py, a plain DeepSpeed
script), each started by its usual launcher in fresh interpreters of the *installed* package, with
the shipped configs and batch sizes / learning rates of their own. In every cell of
{Trainer, accelerate, DeepSpeed} x {zero1, a bare ``{"mode": "acco"}``, demo}, with rank 1 three
times slower (``SLOW_RANKS``, ``examples/common.py``) in the zero1 and acco cells of the
two-rank scripts: the engine is LowCommEngine, lowcomm's numbers reach the logs, the loss falls,
checkpoints save every 10 steps and a run resumed from step 20 applies exactly the 10 updates
left: the script's step count, DeepSpeed's ``global_steps``, the checkpoint tag, the AdamW step
count and the LR schedule saved in each checkpoint agree. Under the Trainer the slowed rank paces
(``lowcomm.pace``): its logged computed share is below 1.
With ``DS_LOWCOMM_AUTOLOAD=0`` each kind of script (each with another mode) stops before training,
saying how to turn it on.

One tokenizer and one text file serve the whole matrix; the model is a 1-layer GPT-2 built from
its config in each script.
"""
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import workers
from dist import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "user_scripts"
BIN = Path(sys.executable).parent
MODEL = "n_embd=32,n_layer=1,n_head=2,n_positions=32,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"
STEPS, SAVE_EVERY, RESUME_AT = 30, 10, 20
MODES = ("zero1", "acco", "demo")
SCRIPT_KINDS = ("trainer", "accelerate", "deepspeed")
#: acco as a user who adds one line to a config of their own writes it (its defaults follow the loop)
BARE_ACCO = {"mode": "acco"}
SLOW = "1:3"  # rank 1 three times slower, in the zero1 and acco cells of the two-rank scripts
OFF_MESSAGE = "ds_lowcomm is not active (DS_LOWCOMM_AUTOLOAD=0). Unset DS_LOWCOMM_AUTOLOAD"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A text file and a byte-level BPE tokenizer trained on it, saved as a local HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = tmp_path_factory.mktemp("user_assets")
    text = workers.corpus()[:120_000].decode("utf-8", errors="ignore")
    data = base / "train.txt"
    data.write_text(text, encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>", model_max_length=32).save_pretrained(base / "tokenizer")
    return {"data": str(data), "tokenizer": str(base / "tokenizer")}


def _monitored(cfg: dict, out: Path) -> dict:
    """The user's config plus DeepSpeed's own CSV monitor (lowcomm's numbers go to every monitor)."""
    return {**cfg, "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "run"}}


def _command(kind, mode, assets, out: Path, nprocs: int, resume: bool):
    """The launcher command a user of this kind of script types."""
    if kind == "trainer":
        cfg = json.loads((ROOT / "ds_configs" / "hf" / f"{mode}.json").read_text())
        if mode == "acco":
            cfg["lowcomm"] = BARE_ACCO
        (out / "ds_config.json").write_text(json.dumps(cfg))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
               "--master_port", str(free_port()), str(SCRIPTS / "run_clm.py"),
               "--deepspeed", str(out / "ds_config.json"),
               "--model_type", "gpt2", "--config_overrides", MODEL, "--tokenizer_name", assets["tokenizer"],
               "--train_file", assets["data"], "--block_size", "32", "--output_dir", str(out),
               "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
               "--learning_rate", "2e-3", "--weight_decay", "0.05", "--warmup_steps", "2",
               "--max_steps", str(STEPS), "--save_steps", str(SAVE_EVERY), "--logging_steps", "1",
               "--use_cpu", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true"]
        return cmd + (["--resume_from_checkpoint", str(out / f"checkpoint-{RESUME_AT}")] if resume else [])
    if kind == "accelerate":
        cfg = json.loads((ROOT / "ds_configs" / "hf" / f"{mode}.json").read_text())
        if mode == "acco":
            cfg["lowcomm"] = BARE_ACCO
        (out / "ds_config.json").write_text(json.dumps(_monitored(cfg, out)))
        (out / "accelerate.yaml").write_text(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
            f"deepspeed_config:\n  deepspeed_config_file: {out / 'ds_config.json'}\n  zero3_init_flag: false\n"
            f"num_processes: {nprocs}\nnum_machines: 1\nmachine_rank: 0\n"
            f"main_process_port: {free_port()}\nuse_cpu: false\n")
        cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(out / "accelerate.yaml"),
               str(SCRIPTS / "run_clm_no_trainer.py"), "--train_file", assets["data"],
               "--tokenizer_name", assets["tokenizer"], "--config_overrides", MODEL, "--block_size", "32",
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
               "--learning_rate", "3e-3", "--weight_decay", "0.1", "--num_warmup_steps", "1",
               "--max_train_steps", str(STEPS), "--checkpointing_steps", str(SAVE_EVERY), "--seed", "0",
               "--output_dir", str(out)]
        return cmd + (["--resume_from_checkpoint", str(out / f"step_{RESUME_AT}")] if resume else [])
    cfg = json.loads((ROOT / "ds_configs" / f"{mode}_zero1.json" if mode != "zero1" else
                      ROOT / "ds_configs" / "zero1.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    if mode == "acco":
        cfg["lowcomm"] = BARE_ACCO
    (out / "ds_config.json").write_text(json.dumps(_monitored(cfg, out)))
    cmd = [str(BIN / "deepspeed"), "--num_accelerators", str(nprocs), "--master_port", str(free_port()),
           str(SCRIPTS / "train_deepspeed.py"), "--deepspeed", "--deepspeed_config", str(out / "ds_config.json"),
           "--train_file", assets["data"], "--tokenizer_name", assets["tokenizer"],
           "--config_overrides", MODEL, "--max_steps", str(STEPS), "--save_dir", str(out),
           "--save_interval", str(SAVE_EVERY)]
    return cmd + (["--resume_tag", f"global_step{RESUME_AT}"] if resume else [])


def _slowed(kind, mode) -> bool:
    return kind != "accelerate" and mode in ("zero1", "acco")  # (accelerate: one process here)


def _run(kind, mode, assets, out: Path, nprocs=2, resume=False, extra_env=None):
    out.mkdir(parents=True, exist_ok=True)
    # The slowed rank only where the launch has it (one process: --slow-ranks 1:3 is refused).
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", HF_HOME=str(out.parent / "hf_home"), TOKENIZERS_PARALLELISM="false",
               SLOW_RANKS=SLOW if _slowed(kind, mode) and nprocs > 1 else "")
    env.update(extra_env or {})
    env.pop("PYTHONPATH", None)
    if env["SLOW_RANKS"]:  # the emulated slower GPU the scripts import (examples/common.py): no ds_lowcomm there
        env["PYTHONPATH"] = str(ROOT / "examples")
    # From an empty directory: ds_lowcomm can only come from the installation, as for a user.
    cwd = out.parent / "cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.run(_command(kind, mode, assets, out, nprocs, resume), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _results(out: Path, nprocs: int) -> list:
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(nprocs)]


def _nprocs(kind: str) -> int:
    # accelerate 1.15 runs DeepSpeed on CPU with one process only (its use_cpu switches DeepSpeed off).
    return 1 if kind == "accelerate" else 2


def _saved_counts(out: Path, kind: str, step: int) -> dict:
    """Step counts the script's checkpoint for ``step`` records, read with torch.load alone:
    DeepSpeed's model-states file, and the LR schedule wherever the script keeps it."""
    ckpt = {"trainer": out / f"checkpoint-{step}", "accelerate": out / f"step_{step}", "deepspeed": out}[kind]
    tag = {"trainer": f"global_step{step}", "accelerate": "pytorch_model", "deepspeed": f"global_step{step}"}[kind]
    state = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    counts = {"global_steps": state["global_steps"], "adamw_steps": state["optimizer"]["step"]}
    if kind == "deepspeed":  # the JSON's scheduler, stepped by DeepSpeed, counts from -1
        counts["lr_schedule_steps"] = state["lr_scheduler"]["last_batch_iteration"] + 1
    else:  # the script's own torch scheduler, saved beside DeepSpeed's files
        saved = torch.load(ckpt / ("scheduler.pt" if kind == "trainer" else "scheduler.bin"), weights_only=True)
        counts["lr_schedule_steps"] = saved["last_epoch"]
    return counts


# and "mode": "automatic" under the Trainer (ds_configs/hf/automatic.json): it chooses at the first
# micro-batch, and the resumed run takes the mode its checkpoint was written in
@pytest.mark.parametrize("kind,mode", [(k, m) for m in MODES for k in SCRIPT_KINDS] + [("trainer", "automatic")])
def test_user_script_trains_saves_and_resumes(tmp_path, assets, kind, mode):
    n, out = _nprocs(kind), tmp_path / "run"
    first = _run(kind, mode, assets, out, n)
    assert first.returncode == 0, first.stderr[-4000:]
    if mode == "automatic":
        assert "ds_lowcomm: mode automatic chose " in first.stderr + first.stdout, first.stderr[-4000:]
    purelib = Path(sysconfig.get_paths()["purelib"]).resolve()
    for r in _results(out, n):
        assert r["engine"] == "LowCommEngine"
        assert Path(r["lowcomm_module"]).resolve().is_relative_to(purelib), r["lowcomm_module"]
        assert r["engine_global_steps"] == STEPS
    r0 = _results(out, n)[0]
    # The slowed rank ran some micro-batches forward only (lowcomm.pace, by default where the loop
    # marks its own boundaries), the fast one none; in a plain DeepSpeed loop acco computes while
    # it waits instead (its balance).
    paced = _slowed(kind, mode) and kind == "trainer"
    if kind == "trainer":
        logs = [e for e in r0["log"] if "loss" in e]
        assert [e["step"] for e in logs] == list(range(1, STEPS + 1))
        assert logs[-1]["loss"] < logs[0]["loss"]
        assert logs[-1]["lowcomm/bytes_sent_per_step"] > 0 and "lowcomm/exposed_comm_s_per_step" in logs[-1]
        if paced:
            shares = (logs[-1].get("lowcomm/computed_share/rank0"), logs[-1].get("lowcomm/computed_share/rank1"))
            assert shares[0] == 1.0 and shares[1] is not None and shares[1] < 1.0, shares
    else:
        losses = r0["losses"]
        assert sum(losses[-4:]) < sum(losses[:4])
        monitor = out / "run" / "Train_lowcomm_bytes_sent_per_step.csv"  # DeepSpeed's CSV monitor
        assert monitor.is_file(), sorted(p.name for p in out.rglob("*.csv"))
        if paced:
            share = out / "run" / "Train_lowcomm_computed_share_rank1.csv"
            assert share.is_file(), sorted(p.name for p in out.rglob("*.csv"))
            assert float(share.read_text().split()[-1].split(",")[-1]) < 1.0
    # Every checkpoint's tag, DeepSpeed's step, the AdamW updates and the LR schedule agree.
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
        counts = _saved_counts(out, kind, step)
        assert set(counts.values()) == {step}, (step, counts)

    # Only what the resumed run writes may count: drop the first run's results and later saves.
    for f in out.glob("result_rank*.json"):
        f.unlink()
    later = {"trainer": out / f"checkpoint-{STEPS}", "accelerate": out / f"step_{STEPS}",
             "deepspeed": out / f"global_step{STEPS}"}[kind]
    shutil.rmtree(later)
    second = _run(kind, mode, assets, out, n, resume=True)
    assert second.returncode == 0, second.stderr[-4000:]
    if mode == "automatic":  # the checkpoint's mode, measured nothing
        output = second.stderr + second.stdout
        assert "ds_lowcomm: mode automatic resumes in " in output and "mode automatic chose" not in output, output[-4000:]
    for r in _results(out, n):
        assert r["engine"] == "LowCommEngine"
        assert r["engine_global_steps"] == STEPS
    # Resumed at RESUME_AT, the run applied exactly the STEPS - RESUME_AT updates left and saved
    # them under the right tag.
    assert set(_saved_counts(out, kind, STEPS).values()) == {STEPS}
    if kind == "accelerate":  # it computed just the micro-batches of the steps left
        assert len(_results(out, n)[0]["losses"]) == (STEPS - RESUME_AT) * 2
    if kind == "trainer":
        logs = [e for e in _results(out, n)[0]["log"] if "loss" in e]
        assert [e["step"] for e in logs] == list(range(1, STEPS + 1))  # the first 20 from the checkpoint
        assert _results(out, n)[0]["global_step"] == STEPS


def _refusal(kind, mode, assets, out: Path):
    """What went wrong with this cell under DS_LOWCOMM_AUTOLOAD=0, or None if it refused properly."""
    res = _run(kind, mode, assets, out, nprocs=1, extra_env={"DS_LOWCOMM_AUTOLOAD": "0"})
    output = res.stderr + res.stdout
    if res.returncode == 0 or OFF_MESSAGE not in output:
        return f"exit {res.returncode}, no refusal message:\n{output[-2000:]}"
    trained = [p.name for p in out.rglob("*") if p.name.startswith(("result_rank", "checkpoint-", "step_", "global_step"))]
    return f"trained or saved before refusing: {trained}" if trained else None


def test_each_kind_of_script_refuses_without_autoload(tmp_path, assets):
    # Each kind of script once and each mode once: the refusal comes from the config's "lowcomm"
    # section, whatever its mode, at the launcher's engine start.
    cells = list(zip(SCRIPT_KINDS, MODES))
    # Two at a time: each is one process that stops before training, mostly importing.
    with ThreadPoolExecutor(2) as pool:
        problems = list(pool.map(lambda c: _refusal(*c, assets, tmp_path / f"{c[0]}-{c[1]}" / "run"), cells))
    failed = {f"{k}-{m}": p for (k, m), p in zip(cells, problems) if p is not None}
    assert not failed, failed
