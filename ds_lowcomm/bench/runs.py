"""One run of one mode: its config, its command line (``examples/train.py``, ``finetune_hf.py`` or
``train_ddp.py``), its launch behind the link, and the result line and records it leaves."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from ds_lowcomm import configs
from ds_lowcomm.bench.analysis import ideal_records, read_records
from ds_lowcomm.bench.link import Link, free_port


#: the folder ds_lowcomm is imported from; when it is a source checkout (not site-packages), it
#: goes first on the runs' PYTHONPATH, so they train with the same code as the bench
ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = (ROOT / "setup.py").is_file()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


TRAIN = EXAMPLES / "train.py"


FINETUNE = EXAMPLES / "finetune_hf.py"


TRAIN_DDP = EXAMPLES / "train_ddp.py"


CONFIGS = {"ideal": "zero1.json", "ddp": "deepspeed_zero1.json", "ddp-powersgd": "deepspeed_zero1.json",
           "deepspeed": "deepspeed_zero1.json", "zero1": "zero1.json", "zero1-overlap": "zero1.json",
           "acco": "acco_zero1.json", "acco-fp32-estimate": "acco_zero1.json",
           "acco-fp32-gather": "acco_zero1.json", "dpu": "dpu_zero1.json",
           "demo": "demo_zero1.json", "demo-overlap": "demo_zero1.json", "desloc": "desloc_zero1.json",
           "desloc-compressed": "desloc_zero1.json", "desloc-streamed": "desloc_zero1.json",
           "desloc-muon": "desloc_zero1.json",
           "diloco": "desloc_zero1.json", "zero1-slowest": "zero1.json", "automatic": "automatic.json"}


#: the shipped configs a regime uses instead of CONFIGS' (its link makes other settings win)
REGIME_CONFIGS = {regime: {"demo": "demo_slow_link.json", "demo-overlap": "demo_slow_link.json",
                           "desloc": "desloc_slow_link.json", "desloc-compressed": "desloc_slow_link.json",
                           "desloc-streamed": "desloc_slow_link.json",
                           "desloc-muon": "desloc_muon_slow_link.json", "diloco": "desloc_slow_link.json"}
                  for regime in ("slow", "two-node")}


#: modes that are a shipped config with options changed: merged into its "lowcomm" section
VARIANTS = {"zero1-overlap": {"zero1": {"overlap": True}},
            "acco-fp32-estimate": {"acco": {"estimate_dtype": "fp32", "real_gather_dtype": "fp32"}},
            "acco-fp32-gather": {"acco": {"real_gather_dtype": "fp32"}},
            # (no look-ahead: it needs shard_group_size 1, which two-node's demo does not have)
            "demo-overlap": {"demo": {"overlap": True, "lookahead": False}},
            # compressed parameter syncs, moments never averaged (their dense syncs would dominate)
            "desloc-compressed": {"desloc": {"sync_topk": 1, "momentum_sync_every": 0, "variance_sync_every": 0}},
            # streamed parameter syncs, applied 12 steps late: about a slow-regime sync's time in
            # steps of compute, so its all-reduce hides behind them (needs param_sync_every > 12)
            "desloc-streamed": {"desloc": {"param_sync_delay": 12}},
            # Muon as the local step (as MuLoCo, arXiv 2505.23725, takes it for DiLoCo)
            "desloc-muon": {"desloc": {"inner_optimizer": "muon"}},
            # DiLoCo (arXiv 2311.08105) as its users run it: inner AdamW per replica, every H steps an
            # outer Nesterov step (lr 0.7, momentum 0.9) on the averaged parameters, moments local
            "diloco": {"desloc": {"momentum_sync_every": 0, "variance_sync_every": 0, "outer_lr": 0.7,
                                  "outer_momentum": 0.9}}}


#: modes that are a shipped config with top-level "lowcomm" options changed
LOWCOMM_OPTIONS = {"zero1-slowest": {"pace": "slowest"}}


#: --regime uneven-trainer's modes: the config examples/finetune_hf.py runs (None: no DeepSpeed,
#: the Trainer's DDP); "deepspeed" drops the "lowcomm" section (stock ZeRO-1)
TRAINER_CONFIGS = {"zero1": "hf/zero1.json", "zero1-slowest": "hf/zero1.json", "acco": "hf/acco.json",
                   "deepspeed": "hf/zero1.json", "ddp": None}




#: its default step budgets (a 20-step run of the default model: ~30-50 s on 2 CPU cores)
TRAINER_BUDGETS = [20, 40, 60]






REGIMES = ("fast", "moderate", "slow", "uneven", "two-node", "uneven-trainer")


#: compute steps one DDP sync should take on the link, per regime
SYNC_STEPS = {"moderate": 1.0, "slow": 10.0, "two-node": 10.0}


MODELS = {  # name: (n_layer, n_head, n_embd, block_size, dropout; None: the training script's default)
    "tiny": (1, 2, 32, 32, None),
    "small": (4, 4, 128, 128, None),
    "base": (6, 6, 384, 256, 0.2),  # nanoGPT's shakespeare-char model, its dropout included
}


#: ``optimizer.<param>`` settings, written into a config's optimizer params: examples/train_ddp.py
#: builds torch's AdamW from these four; a ds_lowcomm mode uses those its step has (demo has no
#: betas or eps, Muon's matrices their own momentum)
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")


def is_optimizer_setting(key: str) -> bool:
    """``optimizer.<param>``: a setting of the config's optimizer, not of its "lowcomm" section."""
    return key.startswith("optimizer.")


def parse_setting(text: str) -> Tuple[str, object]:
    """``KEY=VALUE`` (a "lowcomm" option, e.g. ``demo.topk=8``, or ``optimizer.lr=0.003``, one of
    :data:`OPTIMIZER_PARAMS`; VALUE read as JSON where it parses, else as a string); ValueError
    names the expected form."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"{text!r}: expected KEY=VALUE, e.g. demo.topk=8")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def split_mode(entry: str) -> Tuple[str, List[Tuple[str, object]]]:
    """A ``--modes`` entry, ``MODE[:KEY=VALUE...]``: the bench mode and the options that entry alone
    runs with (``--set``'s syntax, applied after ``--set``), so one bench can run a mode at several
    settings side by side (``desloc-streamed:desloc.param_sync_delay=4``). The whole entry is the
    run's label in the logs and tables. A VALUE cannot hold ``:`` or ``,`` (the separators)."""
    mode, *settings = entry.split(":")
    return mode, [parse_setting(s) for s in settings]


def config_name(entry: str, regime: Optional[str]) -> Optional[str]:
    """The shipped config (in ds_configs/) ``entry``'s mode starts from under ``regime`` (None: no DeepSpeed)."""
    mode = split_mode(entry)[0]
    if regime == "uneven-trainer":
        return TRAINER_CONFIGS[mode]
    return REGIME_CONFIGS.get(regime, {}).get(mode, CONFIGS[mode])


def apply_setting(cfg: dict, key: str, value) -> None:
    """Set "lowcomm" option ``key`` (dotted) in ``cfg``: ``demo.topk`` only touches a demo config
    and an ``automatic`` one (there the user's own key, which wins over its pick for demo),
    ``comm_dtype`` every config with a "lowcomm" section; ``optimizer.lr`` sets the optimizer's
    ``lr`` in every config, the peers' (``ddp``) included, so each method can run at its own best
    learning rate."""
    if is_optimizer_setting(key):  # every config but the Trainer's has one; its regime refuses these
        cfg["optimizer"]["params"][key.split(".", 1)[1]] = value
        return
    section = cfg.get("lowcomm")
    head, *rest = key.split(".")
    if section is None or (rest and head != section["mode"] and section["mode"] != "automatic"):
        return
    node = section
    for k in key.split(".")[:-1]:
        node = node.setdefault(k, {})
    node[key.split(".")[-1]] = value


def write_config(entry: str, args, out: Path, steps: int) -> Optional[Path]:
    """``entry``'s config for a ``steps``-step run, written to ``out/configs`` (None: no DeepSpeed)."""
    name = config_name(entry, args.regime)
    mode, own = split_mode(entry)
    if name is None:
        return None
    cfg = json.loads(Path(configs.path(name)).read_text())
    if args.regime == "uneven-trainer":
        # the Trainer fills the "auto" batch sizes from the script's flags and builds its own
        # optimizer and LR schedule (warm-up a tenth, cosine), spanning --max-steps: the budget
        if mode == "deepspeed":
            cfg.pop("lowcomm", None)
    else:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
        cfg["gradient_accumulation_steps"] = args.gas
    if "scheduler" in cfg:  # the schedule spans the run's budget
        cfg["scheduler"]["params"].update(total_num_steps=steps, warmup_num_steps=max(1, steps // 10))
    for section, options in VARIANTS.get(mode, {}).items():
        cfg["lowcomm"].setdefault(section, {}).update(options)
    cfg.get("lowcomm", {}).update(LOWCOMM_OPTIONS.get(mode, {}))
    if args.regime == "two-node" and cfg.get("lowcomm", {}).get("mode") in ("demo", "desloc"):
        cfg["lowcomm"]["shard_group_size"] = args.world_size // 2  # ZeRO-1 inside a node
    if args.comm_dtype and "lowcomm" in cfg:
        cfg["lowcomm"]["comm_dtype"] = args.comm_dtype
    if args.acco_wait and "acco" in cfg.get("lowcomm", {}):
        cfg["lowcomm"]["acco"]["accumulate_while_waiting"] = False
    for key, value in args.set + own:
        apply_setting(cfg, key, value)
    path = out / "configs" / f"{entry}.{steps}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


def train_command(args, mode: str, config: Path, nproc: int, log_json: Path, slow: str, link: "Link",
                  steps: int, launcher: Optional[List[str]] = None) -> List[str]:
    mode = split_mode(mode)[0]
    n_layer, n_head, n_embd, block, _ = MODELS[args.model]
    launcher = launcher or ["--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    script = [str(TRAIN_DDP), "--powersgd-rank", str(args.powersgd_rank if mode == "ddp-powersgd" else 0)] \
        if mode.startswith("ddp") else [str(TRAIN)]
    if mode == "ddp-powersgd" and args.powersgd_warmup:
        script += ["--powersgd-warmup", str(args.powersgd_warmup)]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, *script, "--deepspeed", str(config),
           "--max-steps", str(steps), "--eval-every", str(max(1, steps // args.evals)),
           "--eval-iters", str(args.eval_iters),
           "--log-every", str(max(1, steps // 20)), "--seed", str(args.seed),
           "--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd),
           "--block-size", str(block), "--tokenizer", args.tokenizer, "--log-json", str(log_json)]
    if args.dropout is not None:
        cmd += ["--dropout", str(args.dropout)]
    if link.ns and link.nodes == 1:  # the interface counters only mean something in our private namespace
        cmd.append("--link-counter")
    if args.data:
        cmd += ["--data", args.data]
    if slow:
        cmd += ["--slow-ranks", slow]
    return cmd


def trainer_command(args, config: Optional[Path], log_json: Path, steps: int, output_dir: Path) -> List[str]:
    """``examples/finetune_hf.py`` (the Hugging Face Trainer) for ``--regime uneven-trainer``:
    no ``--deepspeed`` (``config`` None) runs the Trainer's DDP."""
    n_layer, n_head, n_embd, block, _ = MODELS[args.model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
           "--master_port", str(free_port()), str(FINETUNE)]
    if config is not None:
        cmd += ["--deepspeed", str(config)]
    cmd += ["--max-steps", str(steps), "--eval-every", str(max(1, steps // args.evals)),
            "--eval-iters", str(args.eval_iters), "--log-every", str(max(1, steps // 20)),
            "--seed", str(args.seed), "--micro-batch", str(args.micro_batch), "--gas", str(args.gas),
            "--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd),
            "--block-size", str(block), "--log-json", str(log_json), "--output-dir", str(output_dir)]
    if args.dropout is not None:
        cmd += ["--dropout", str(args.dropout)]
    if args.data:
        cmd += ["--data", args.data]
    if args.slow_rank:
        cmd += ["--slow-ranks", args.slow_rank]
    return cmd


def run_env(accelerator: str) -> dict:
    """The environment of a bench's launches: one thread per rank, ``DS_ACCELERATOR`` (unless
    set), and from a source checkout the checkout first on ``PYTHONPATH``, so the ranks import the
    package the bench imported (an install's ranks find it without help)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("DS_ACCELERATOR", accelerator)
    if CHECKOUT:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_one(args, mode: str, link: Link, out: Path, label: str, steps: int) -> dict:
    """One training of ``steps`` optimizer steps; returns its result JSON (plus the records)."""
    config = write_config(mode, args, out, steps)
    env = run_env("cpu" if not _cuda() else "cuda")
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    if args.regime == "uneven-trainer":
        log_json = logs / f"{label}.jsonl"
        log_json.unlink(missing_ok=True)
        output_dir = out / "hf_runs" / label  # the Trainer's output (the final model): removed after
        proc = _launch(trainer_command(args, config, log_json, steps, output_dir), env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text = _follow(proc, label, logs / f"{label}.log")
        shutil.rmtree(output_dir, ignore_errors=True)
        try:
            output_dir.parent.rmdir()  # when it was the last
        except OSError:
            pass
        result = _result(text, label)
        result["mode"] = mode
        result["records"] = read_records(log_json)
        return result
    if mode == "ideal":  # (it takes no options: parse_args refuses them)
        # W single-rank trainings at once: same per-rank work and machine load, no communication.
        # A slowed rank keeps its slowdown.
        slow = dict(p.split(":") for p in args.slow_rank.split(",") if p) if args.slow_rank else {}
        procs = []
        for r in range(args.world_size):
            log_json = logs / f"{label}.rank{r}.jsonl"
            log_json.unlink(missing_ok=True)
            cmd = train_command(args, mode, config, 1, log_json, f"0:{slow[str(r)]}" if str(r) in slow else "",
                                link, steps)
            procs.append(_launch(link.prefix() + cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = [_follow(p, f"{label} rank {r}", logs / f"{label}.rank{r}.log", quiet=r > 0)
                for r, p in enumerate(procs)]
        parts = [_result(o, label) for o in outs]
        result = dict(parts[0])
        result.update(world_size=args.world_size, mode="ideal",
                      tokens_per_s=sum(p["tokens_per_s"] for p in parts),
                      tokens=sum(p["tokens"] for p in parts),
                      step_time_s=max(p["step_time_s"] for p in parts),
                      final_train_loss=statistics.mean(p["final_train_loss"] for p in parts),
                      val_loss=statistics.mean(p["val_loss"] for p in parts),
                      bytes_sent_per_rank_per_step=0.0, bytes_received_per_rank_per_step=0.0,
                      exposed_comm_s_per_step=0.0, link_bytes_per_rank_per_step=None)
        result["records"] = ideal_records(logs / f"{label}.rank0.jsonl", args.world_size)
        return result
    log_json = logs / f"{label}.jsonl"
    log_json.unlink(missing_ok=True)
    if link.nodes == 1:
        cmd = train_command(args, mode, config, args.world_size, log_json, args.slow_rank or "", link, steps)
        proc = _launch(link.prefix() + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        text = _follow(proc, label, logs / f"{label}.log")
        link_bytes = None
    else:  # one launcher per node, each in its namespace; node 0 holds rank 0 (the results)
        port, per_node = free_port(), args.world_size // link.nodes
        before = link.counters()
        procs = []
        for node in range(link.nodes):
            launcher = ["--nnodes", str(link.nodes), "--node_rank", str(node), "--nproc_per_node", str(per_node),
                        "--master_addr", link.node_env(node)["MASTER_ADDR"], "--master_port", str(port)]
            cmd = train_command(args, mode, config, per_node, log_json, args.slow_rank or "", link, steps, launcher)
            # Other nodes write to a file: an unread pipe would fill and stall them.
            sink = subprocess.PIPE if node == 0 else open(logs / f"{label}.node{node}.log", "w")
            procs.append(_launch(link.prefix(node) + cmd, env=dict(env, **link.node_env(node)),
                                          stdout=sink, stderr=subprocess.STDOUT, text=True))
        text = _follow(procs[0], label, logs / f"{label}.log")
        for node, p in enumerate(procs[1:], 1):
            if p.wait() != 0:
                raise RuntimeError(f"{label}: node {node} exited with {p.returncode}; see "
                                   f"{logs / f'{label}.node{node}.log'}")
        link_bytes = link.counters() - before  # the whole job's, set-up and validation included
    result = _result(text, label)
    result["mode"] = mode  # train.py names the mode of the config: "zero1" for zero1-overlap
    if link_bytes is not None:
        result["link_bytes_per_rank_per_step"] = link_bytes / args.world_size / steps
    result["records"] = read_records(log_json)
    return result


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _follow(proc: subprocess.Popen, label: str, log: Path, quiet: bool = False) -> str:
    """Stream a run's progress lines and return its whole output, written to ``log`` whether or not
    the run succeeded (the bench's failure message points there)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if not quiet and re.match(r"^step \d+/\d+ \|", line):
            print(f"  [{label}] {line.strip()}", flush=True)
    proc.wait()
    text = "".join(lines)
    log.write_text(text)
    if proc.returncode != 0:
        why = last_error(text)
        raise RuntimeError(f"{label}: training exited with {proc.returncode}:{' ' + why if why else ''}\n"
                           f"{text[-4000:]}")
    return text


#: a line that names an error: a Python exception (``ValueError: ...``) or a script's ``error: ...``
#: (argparse's ``prog: error: ...`` too), torchrun's ``[rank1]:`` prefix allowed
ERROR_LINE = re.compile(r"^(\[[^\]]*\]:?\s*)?([\w.]*(Error|Exception|Interrupt)\b.*|([^\s:][^:]*: )?error: .*)$")


def last_error(output: str) -> str:
    """The last line of a run's ``output`` that names an error, for the benches' one-line failure
    messages; torchrun's own closing ``ChildFailedError`` (which only says that a worker failed) is
    passed over. '' when there is none."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if ERROR_LINE.match(line) and "ChildFailedError" not in line:
            return line
    return ""


def _result(output: str, label: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{label}: no JSON result line in the output:\n{output[-2000:]}")


def link_rate(regime: str, step_s: float, params: int, world: int) -> Tuple[str, float]:
    """(tc rate, bytes per sync on the limited link) at which one DDP sync of ``params`` fp32
    gradients takes ``SYNC_STEPS[regime]`` compute steps of ``step_s``. A sync moves
    2(W-1)/W · 4P bytes per rank; on one namespace's loopback every rank's traffic shares the
    limit (W times that); between two nodes each direction carries one ring edge's share."""
    per_rank = 2 * (world - 1) / world * 4 * params
    on_link = per_rank if regime == "two-node" else world * per_rank
    bits_per_s = 8 * on_link / (SYNC_STEPS[regime] * step_s)
    return f"{max(1, round(bits_per_s / 1e3))}kbit", on_link


def calibrate(args, out: Path) -> str:
    """The regime's link rate from this machine's compute time per step, measured by a short run
    with no communication (:func:`link_rate`)."""
    probe = run_one(args, "ideal", Link(None, None), out, "calibration", args.calibration_steps)
    step_s, params = probe["step_time_s"], probe["params"]
    rate, on_link = link_rate(args.regime, step_s, params, args.world_size)
    print(f"calibration: {step_s:.3f} s of compute per step, {params:,} parameters; a DDP sync puts "
          f"{on_link / 1e6:.2f} MB on the {'inter-node ' if args.regime == 'two-node' else ''}link: "
          f"{args.regime} = {SYNC_STEPS[args.regime]:g} step(s) per sync -> --bandwidth {rate}", flush=True)
    return rate


#: every training launch of this bench, so that a bench told to stop stops its runs too
_LAUNCHED: List[subprocess.Popen] = []


def _launch(cmd: List[str], **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, **kwargs)
    _LAUNCHED.append(proc)
    return proc


def _stop_on_sigterm() -> None:
    """On SIGTERM (a job scheduler, ``kill``): stop the running launches (the launcher stops its
    ranks), then exit through the ``finally`` blocks, which remove the network namespaces, as
    Ctrl-C does (the terminal's SIGINT reaches the runs by itself)."""
    def stop(signum, frame):
        running = [p for p in _LAUNCHED if p.poll() is None]
        for p in running:
            p.terminate()
        for p in running:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
