"""Every mode and its peers side by side, timed to a target loss: ``python -m ds_lowcomm.bench``.

Runs ``examples/train.py`` with the same model, data, seed, sampler and schedule under each of
``--modes`` (and each step budget of ``--budgets``) and writes ``results.json``, ``results.md`` and
plots into ``--out``:

- ``ideal``: the same per-rank work with no communication at all: W independent single-rank
  trainings at once on the same machine (the physical limit);
- ``ddp``: plain PyTorch ``DistributedDataParallel`` (``examples/train_ddp.py``: train.py's
  training with DDP's bucketed all-reduce, overlapped with the backward pass);
- ``ddp-powersgd``: the same with PyTorch's PowerSGD comm hook (``--powersgd-rank``, warm-up
  ``--powersgd-warmup``);
- ``deepspeed``: stock DeepSpeed ZeRO-1 (``ds_configs/deepspeed_zero1.json``);
- ``zero1``, ``acco``, ``dpu``, ``demo``, ``desloc``: ds_lowcomm modes (``ds_configs/<mode>*.json``);
  variants of a shipped config (``VARIANTS``): ``zero1-overlap`` (``"zero1": {"overlap": true}``),
  ``acco-fp32-estimate`` (``"acco": {"estimate_dtype": "fp32", "real_gather_dtype": "fp32"}``, the
  paper's rounds), ``acco-fp32-gather`` (``"acco": {"real_gather_dtype": "fp32"}``, the real round's
  parameters gathered whole), ``demo-overlap`` (``"demo": {"overlap": true, "lookahead": false}``),
  ``zero1-slowest`` (``"pace": "slowest"``: every rank computes every micro-batch it is handed).

The headline is the training time until the validation loss reaches a target: ``--target``, or by
default the final validation loss of the synchronous baseline (``ddp``, else ``deepspeed``, else
``zero1``, at its longest budget), raised by ``TARGET_TOLERANCE`` (1e-4, relative) so that an
exact method that ends on the same loss up to float rounding counts as reaching it. Validation
runs at ``--evals`` fixed steps per run, off the training clock. The schedule follows the budget (the LR decays to the end of each run), and the
budget decides who wins: ``--budgets 100,200,400`` runs every mode, peers included, at each, and
each mode is reported at the budget that reached the target soonest.

``--regime`` sets up a link: ``fast`` (none), ``moderate`` (a DDP sync takes about one step of
compute), ``slow`` (about ten), ``uneven`` (rank 1 three times slower per micro-batch) and
``two-node`` (4 ranks as 2 nodes of 2: fast inside a node, a rate-limited link between them).
``uneven-trainer`` is ``uneven`` under the Hugging Face Trainer (``examples/finetune_hf.py``, which
hands every rank the same micro-batches) instead of ``examples/train.py``: modes ``zero1``
(``ds_configs/hf/zero1.json``, ``"pace": "fastest"`` by default: the slow rank runs some micro-batches
forward only), ``zero1-slowest`` (the same with ``"pace": "slowest"``: the slow rank sets the pace;
the synchronous baseline of the default target), ``acco`` (``ds_configs/hf/acco.json``),
``deepspeed`` (``hf/zero1.json`` without its ``"lowcomm"`` section: stock ZeRO-1) and ``ddp`` (the
Trainer with no DeepSpeed); default budgets ``TRAINER_BUDGETS``; the Trainer's own LR schedule
(warm-up a tenth, cosine) spans each budget.
``slow`` and ``two-node`` run ``demo`` and ``desloc`` with their slow-link configs
(``REGIME_CONFIGS``).
``moderate``, ``slow`` and ``two-node`` derive the rate from a short calibration run of this
machine's compute time (printed; ``--bandwidth`` overrides it).

``--bandwidth 100mbit`` runs all ranks in a private network namespace whose loopback is limited by
a token bucket (``tc ... tbf``; ``--latency`` adds netem delay), like a slow shared link. It needs
root; otherwise the bench says so and runs unlimited. Bytes are reported twice: the library's
accounting (none for the peers) and the namespace's interface counters (what really crossed the
link, for every run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
FINETUNE = ROOT / "examples" / "finetune_hf.py"
TRAIN_DDP = ROOT / "examples" / "train_ddp.py"
CONFIGS = {"ideal": "zero1.json", "ddp": "deepspeed_zero1.json", "ddp-powersgd": "deepspeed_zero1.json",
           "deepspeed": "deepspeed_zero1.json", "zero1": "zero1.json", "zero1-overlap": "zero1.json",
           "acco": "acco_zero1.json", "acco-fp32-estimate": "acco_zero1.json",
           "acco-fp32-gather": "acco_zero1.json", "dpu": "dpu_zero1.json",
           "demo": "demo_zero1.json", "demo-overlap": "demo_zero1.json", "desloc": "desloc_zero1.json",
           "zero1-slowest": "zero1.json"}
#: the shipped configs a regime uses instead of CONFIGS' (its link makes other settings win)
REGIME_CONFIGS = {regime: {"demo": "demo_slow_link.json", "demo-overlap": "demo_slow_link.json",
                           "desloc": "desloc_slow_link.json"}
                  for regime in ("slow", "two-node")}
#: modes that are a shipped config with options changed: merged into its "lowcomm" section
VARIANTS = {"zero1-overlap": {"zero1": {"overlap": True}},
            "acco-fp32-estimate": {"acco": {"estimate_dtype": "fp32", "real_gather_dtype": "fp32"}},
            "acco-fp32-gather": {"acco": {"real_gather_dtype": "fp32"}},
            # (no look-ahead: it needs shard_group_size 1, which two-node's demo does not have)
            "demo-overlap": {"demo": {"overlap": True, "lookahead": False}}}
#: modes that are a shipped config with top-level "lowcomm" options changed
LOWCOMM_OPTIONS = {"zero1-slowest": {"pace": "slowest"}}
#: --regime uneven-trainer's modes: the config examples/finetune_hf.py runs (None: no DeepSpeed,
#: the Trainer's DDP); "deepspeed" drops the "lowcomm" section (stock ZeRO-1)
TRAINER_CONFIGS = {"zero1": "hf/zero1.json", "zero1-slowest": "hf/zero1.json", "acco": "hf/acco.json",
                   "deepspeed": "hf/zero1.json", "ddp": None}
#: its synchronous baselines (default target, in order of preference), also the table's peers:
#: zero1-slowest is what zero1 did under the Trainer before pacing
TRAINER_BASELINES = ("zero1-slowest", "deepspeed", "ddp")
#: its default step budgets (a 20-step run of the default model: ~30-50 s on 2 CPU cores)
TRAINER_BUDGETS = [20, 40, 60]
PEERS = ("ddp", "ddp-powersgd", "deepspeed")
#: the synchronous baselines whose final val loss is the default target, in order of preference
BASELINES = ("ddp", "deepspeed", "zero1")
REGIMES = ("fast", "moderate", "slow", "uneven", "two-node", "uneven-trainer")
#: compute steps one DDP sync should take on the link, per regime
SYNC_STEPS = {"moderate": 1.0, "slow": 10.0, "two-node": 10.0}
MODELS = {  # name: (n_layer, n_head, n_embd, block_size)
    "tiny": (1, 2, 32, 32),
    "small": (4, 4, 128, 128),
    "base": (6, 6, 384, 256),
}
RUN_KEYS = ("mode", "world_size", "bandwidth", "tokens_per_s", "step_time_s", "exposed_comm_s_per_step",
            "bytes_sent_per_rank_per_step", "bytes_received_per_rank_per_step", "link_bytes_per_step",
            "final_train_loss", "val_loss", "peak_rss_mb", "tokens", "steps", "seconds_to_target",
            "tokens_to_target", "step_to_target")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Link:
    """A private network namespace with a rate-limited loopback, or nothing (unlimited)."""

    def __init__(self, bandwidth: Optional[str], latency: Optional[str]) -> None:
        self.bandwidth, self.latency, self.ns = bandwidth, latency, None
        if not bandwidth and not latency:
            return
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            print(f"bench: --bandwidth/--latency need root and iproute2 (ip, tc); running UNLIMITED "
                  f"on the host loopback instead", flush=True)
            self.bandwidth = self.latency = None
            return
        self.ns = f"lowcomm-bench-{os.getpid()}"
        self._ip("netns", "add", self.ns)
        try:
            self._ip("-n", self.ns, "link", "set", "lo", "up")
            parent = ["root"]
            if latency:
                self._tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem", "delay", latency)
                parent = ["parent", "1:"]
            if bandwidth:
                self._tc("qdisc", "add", "dev", "lo", *parent, "handle", "2:", "tbf", "rate", bandwidth,
                         "burst", "256kb", "latency", "100ms")
        except subprocess.CalledProcessError as err:
            self.close()
            raise SystemExit(f"bench: could not set up the limited link ({' '.join(err.cmd)} failed; "
                             f"--latency needs the kernel's netem qdisc, --bandwidth its tbf qdisc)")

    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True)

    def _tc(self, *args):
        subprocess.run(["tc", "-n", self.ns, *args], check=True)

    nodes = 1

    def prefix(self, node: int = 0) -> List[str]:
        return ["ip", "netns", "exec", self.ns] if self.ns else []

    def node_env(self, node: int) -> dict:
        return {}

    def counters(self) -> Optional[int]:
        """Bytes sent on the limited link so far (None: no private link); train.py reads its
        own namespace's loopback, so this is only used for the two-node link."""
        return None

    def close(self) -> None:
        if self.ns:
            subprocess.run(["ip", "netns", "del", self.ns], check=False)
            self.ns = None


class TwoNodeLink(Link):
    """Two network namespaces ("nodes") joined by a veth pair rate-limited in each direction.

    Ranks of one node reach each other through their namespace's loopback (a node's own address
    is routed through ``lo``: fast, unlimited); ranks of different nodes through the veth.
    """

    nodes = 2
    ADDRS = ("10.77.0.1", "10.77.0.2")

    def __init__(self, bandwidth: Optional[str], latency: Optional[str]) -> None:
        self.bandwidth, self.latency, self.ns, self.names = bandwidth, latency, None, []
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            raise SystemExit("bench: --regime two-node needs root and iproute2 (ip, tc): it builds two "
                             "network namespaces joined by a rate-limited link")
        base = f"lcb{os.getpid()}"
        self.names = [f"{base}-n0", f"{base}-n1"]
        self.ns = self.names[0]
        try:
            for n in self.names:
                self._ip("netns", "add", n)
                self._ip("-n", n, "link", "set", "lo", "up")
            self._ip("link", "add", "lcb0", "netns", self.names[0], "type", "veth", "peer", "name", "lcb1",
                     "netns", self.names[1])
            for i, n in enumerate(self.names):
                self._ip("-n", n, "addr", "add", f"{self.ADDRS[i]}/24", "dev", f"lcb{i}")
                self._ip("-n", n, "link", "set", f"lcb{i}", "up")
                parent = ["root"]
                if latency:
                    subprocess.run(["tc", "-n", n, "qdisc", "add", "dev", f"lcb{i}", "root", "handle", "1:",
                                    "netem", "delay", latency], check=True)
                    parent = ["parent", "1:"]
                if bandwidth:
                    subprocess.run(["tc", "-n", n, "qdisc", "add", "dev", f"lcb{i}", *parent, "handle", "2:",
                                    "tbf", "rate", bandwidth, "burst", "256kb", "latency", "100ms"], check=True)
        except subprocess.CalledProcessError as err:
            self.close()
            raise SystemExit(f"bench: could not set up the two-node link ({' '.join(err.cmd)} failed)")

    def prefix(self, node: int = 0) -> List[str]:
        return ["ip", "netns", "exec", self.names[node]]

    def node_env(self, node: int) -> dict:
        # gloo binds to the veth address: same-node peers are reached through lo, others the veth.
        return {"GLOO_SOCKET_IFNAME": f"lcb{node}", "MASTER_ADDR": self.ADDRS[0]}

    def counters(self) -> Optional[int]:
        total = 0
        for i, n in enumerate(self.names):
            out = subprocess.run(["ip", "netns", "exec", n, "cat", f"/sys/class/net/lcb{i}/statistics/tx_bytes"],
                                 check=True, capture_output=True, text=True).stdout
            total += int(out)
        return total

    def close(self) -> None:
        for n in self.names:
            subprocess.run(["ip", "netns", "del", n], check=False)
        self.names, self.ns = [], None


def config_name(mode: str, regime: Optional[str]) -> Optional[str]:
    """The shipped config (in ds_configs/) ``mode`` starts from under ``regime`` (None: no DeepSpeed)."""
    if regime == "uneven-trainer":
        return TRAINER_CONFIGS[mode]
    return REGIME_CONFIGS.get(regime, {}).get(mode, CONFIGS[mode])


def write_config(mode: str, args, out: Path, steps: int) -> Optional[Path]:
    name = config_name(mode, args.regime)
    if name is None:
        return None
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
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
    for key, value in args.set:
        section = cfg.get("lowcomm")
        head, *rest = key.split(".")
        if section is None or (rest and head != section["mode"]):
            continue  # "demo.topk" only touches the demo config; "comm_dtype" every lowcomm one
        node = section
        for k in key.split(".")[:-1]:
            node = node.setdefault(k, {})
        node[key.split(".")[-1]] = value
    path = out / "configs" / f"{mode}.{steps}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


def train_command(args, mode: str, config: Path, nproc: int, log_json: Path, slow: str, link: "Link",
                  steps: int, launcher: Optional[List[str]] = None) -> List[str]:
    n_layer, n_head, n_embd, block = MODELS[args.model]
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
    n_layer, n_head, n_embd, block = MODELS[args.model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
           "--master_port", str(free_port()), str(FINETUNE)]
    if config is not None:
        cmd += ["--deepspeed", str(config)]
    cmd += ["--max-steps", str(steps), "--eval-every", str(max(1, steps // args.evals)),
            "--eval-iters", str(args.eval_iters), "--log-every", str(max(1, steps // 20)),
            "--seed", str(args.seed), "--micro-batch", str(args.micro_batch), "--gas", str(args.gas),
            "--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd),
            "--block-size", str(block), "--log-json", str(log_json), "--output-dir", str(output_dir)]
    if args.data:
        cmd += ["--data", args.data]
    if args.slow_rank:
        cmd += ["--slow-ranks", args.slow_rank]
    return cmd


def run_one(args, mode: str, link: Link, out: Path, label: str, steps: int) -> dict:
    """One training of ``steps`` optimizer steps; returns its result JSON (plus the records)."""
    config = write_config(mode, args, out, steps)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    if args.regime == "uneven-trainer":
        log_json = logs / f"{label}.jsonl"
        log_json.unlink(missing_ok=True)
        output_dir = out / "hf_runs" / label  # the Trainer's output (the final model): removed after
        proc = _launch(trainer_command(args, config, log_json, steps, output_dir), env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        text = _follow(proc, label)
        (logs / f"{label}.log").write_text(text)
        shutil.rmtree(output_dir, ignore_errors=True)
        try:
            output_dir.parent.rmdir()  # when it was the last
        except OSError:
            pass
        result = _result(text, label)
        result["mode"] = mode
        result["records"] = _records(log_json)
        return result
    if mode == "ideal":
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
                                          stderr=subprocess.STDOUT, text=True, cwd=ROOT))
        outs = [_follow(p, f"{label} rank {r}", quiet=r > 0) for r, p in enumerate(procs)]
        for r, text in enumerate(outs):
            (logs / f"{label}.rank{r}.log").write_text(text)
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
        result["records"] = _ideal_records(logs / f"{label}.rank0.jsonl", args.world_size)
        return result
    log_json = logs / f"{label}.jsonl"
    log_json.unlink(missing_ok=True)
    if link.nodes == 1:
        cmd = train_command(args, mode, config, args.world_size, log_json, args.slow_rank or "", link, steps)
        proc = _launch(link.prefix() + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT)
        text = _follow(proc, label)
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
                                          stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
        text = _follow(procs[0], label)
        for node, p in enumerate(procs[1:], 1):
            if p.wait() != 0:
                raise RuntimeError(f"{label}: node {node} exited with {p.returncode}; see "
                                   f"{logs / f'{label}.node{node}.log'}")
        link_bytes = link.counters() - before  # the whole job's, set-up and validation included
    (logs / f"{label}.log").write_text(text)
    result = _result(text, label)
    result["mode"] = mode  # train.py names the mode of the config: "zero1" for zero1-overlap
    if link_bytes is not None:
        result["link_bytes_per_rank_per_step"] = link_bytes / args.world_size / steps
    result["records"] = _records(log_json)
    return result


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _follow(proc: subprocess.Popen, label: str, quiet: bool = False) -> str:
    """Stream a run's progress lines, return its whole output."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if not quiet and re.match(r"^step \d+/\d+ \|", line):
            print(f"  [{label}] {line.strip()}", flush=True)
    proc.wait()
    text = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: training exited with {proc.returncode}:\n{text[-4000:]}")
    return text


def _result(output: str, label: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{label}: no JSON result line in the output:\n{output[-2000:]}")


def _records(path: Path) -> list:
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def _ideal_records(path: Path, world: int) -> list:
    """``ideal``'s curve: rank 0's, its tokens scaled to all W trainings (they run at one pace)."""
    return [dict(r, tokens=r["tokens"] * world) if "tokens" in r else r for r in _records(path)]


def reload_runs(out: Path) -> Tuple[dict, List[dict]]:
    """A finished bench directory's config and runs, each with its per-step records read back
    from its logs and its time to target cleared (``--retarget``)."""
    try:
        payload = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"bench: --retarget {out}: no readable results.json there ({err}); pass the "
                         f"--out directory of a finished bench run") from None
    runs = payload["runs"]
    for r in runs:
        labels = [f"{r['mode']}.{r['steps']}.{rep}" for rep in range(r["repeats"])]
        if r["mode"] == "ideal":
            recs = [_ideal_records(out / "logs" / f"{label}.rank0.jsonl", r["world_size"]) for label in labels]
        else:
            recs = [_records(out / "logs" / f"{label}.jsonl") for label in labels]
        if not all(recs):
            raise SystemExit(f"bench: --retarget {out}: the per-step log of {r['mode']} at {r['steps']} "
                             f"steps is missing or empty in {out / 'logs'}; retarget the directory the "
                             f"bench wrote, with its logs")
        r.update(all_records=recs, records=recs[len(recs) // 2], seconds_to_target=None,
                 tokens_to_target=None, step_to_target=None)
    return payload["config"], runs


def time_to_target(records: List[dict], target: float) -> Optional[dict]:
    """When the validation loss reached ``target`` (None if it never did): seconds and tokens
    interpolated linearly in the loss between the last validation above the target and the first
    at or below it (that one's own values if it is the first validation), and the step of that
    first validation. ``train_s`` is the training clock, validation excluded (train.py's records)."""
    prev = None
    for r in records:
        if "val_loss" not in r:
            continue
        if r["val_loss"] <= target:
            if prev is None:
                return {"seconds": r["train_s"], "tokens": r["tokens"], "step": r["step"]}
            f = (prev["val_loss"] - target) / (prev["val_loss"] - r["val_loss"])
            return {"seconds": prev["train_s"] + f * (r["train_s"] - prev["train_s"]),
                    "tokens": int(round(prev["tokens"] + f * (r["tokens"] - prev["tokens"]))),
                    "step": r["step"]}
        prev = r
    return None


def summarize(mode: str, runs: List[dict], bandwidth: Optional[str], steps: int) -> dict:
    """Medians over repeats, in the results.json schema (time to target filled in later)."""
    def med(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    link = med("link_bytes_per_rank_per_step")
    return {"mode": mode, "world_size": runs[0]["world_size"], "bandwidth": bandwidth,
            "tokens_per_s": med("tokens_per_s"), "step_time_s": med("step_time_s"),
            "exposed_comm_s_per_step": med("exposed_comm_s_per_step"),
            "bytes_sent_per_rank_per_step": med("bytes_sent_per_rank_per_step"),
            "bytes_received_per_rank_per_step": med("bytes_received_per_rank_per_step"),
            "link_bytes_per_step": link,
            "final_train_loss": med("final_train_loss"), "val_loss": med("val_loss"),
            "peak_rss_mb": med("peak_rss_mb"), "tokens": int(med("tokens")), "steps": steps,
            "repeats": len(runs), "micro_batches_per_round": med("micro_batches_per_round"),
            # lowcomm.pace: each rank's share of its micro-batches computed fully (recent steps)
            "computed_share_by_rank": _median_lists([r.get("computed_share_by_rank") for r in runs]),
            "seconds_to_target": None, "tokens_to_target": None, "step_to_target": None,
            "all_records": [r["records"] for r in runs], "records": runs[len(runs) // 2]["records"]}


def _median_lists(lists: List[Optional[list]]) -> Optional[list]:
    lists = [l for l in lists if l]
    return [statistics.median(v) for v in zip(*lists)] if lists else None


#: relative margin above the baseline's final val loss in the default target: the exact modes end
#: on that loss up to float rounding (another reduction order: 3.0435468 against DDP's 3.0435467)
TARGET_TOLERANCE = 1e-4


def default_target(runs: List[dict], budget: Optional[int] = None,
                   baselines: Tuple[str, ...] = BASELINES) -> Optional[tuple]:
    """(target, what it is): the final val loss of the first synchronous baseline run (of
    ``baselines``), at ``budget`` (default its longest), times 1 + ``TARGET_TOLERANCE``."""
    for name in baselines:
        mine = [r for r in runs if r["mode"] == name]
        if mine:
            if budget is None:
                best = max(mine, key=lambda r: r["steps"])
            else:
                best = next((r for r in mine if r["steps"] == budget), None)
                if best is None:
                    raise SystemExit(f"bench: --target-budget {budget}: {name} ran at "
                                     f"{sorted(r['steps'] for r in mine)} steps only; pick one of those")
            return (best["val_loss"] * (1 + TARGET_TOLERANCE),
                    f"{name}'s final val loss at {best['steps']} steps + {TARGET_TOLERANCE:g}")
    return None


def apply_target(runs: List[dict], target: float) -> None:
    """Seconds, tokens and step to ``target`` for every run: the median over its repeats when
    every repeat got there (else None). Not for ``ideal``: its W trainings are each on 1/W of
    the batch, not the same training, so only its pace means something."""
    for r in runs:
        if r["mode"] == "ideal":
            continue
        hits = [time_to_target(recs, target) for recs in r["all_records"]]
        if hits and all(h is not None for h in hits):
            r["seconds_to_target"] = statistics.median(h["seconds"] for h in hits)
            r["tokens_to_target"] = int(statistics.median(h["tokens"] for h in hits))
            r["step_to_target"] = int(statistics.median(h["step"] for h in hits))


def best_per_mode(runs: List[dict]) -> List[dict]:
    """Each mode at the budget that reached the target soonest (or its longest budget if none did)."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        reached = [r for r in mine if r["seconds_to_target"] is not None]
        out.append(min(reached, key=lambda r: r["seconds_to_target"]) if reached
                   else max(mine, key=lambda r: r["steps"]))
    return out


def _fmt(x, spec, unit=""):
    return "–" if x is None else format(x, spec) + unit


def _ratio(r: dict, peer: Optional[dict]) -> str:
    if peer is None or r["seconds_to_target"] is None or peer["seconds_to_target"] is None:
        return "–"
    return f"{r['seconds_to_target'] / peer['seconds_to_target']:.2f}×"


def markdown(config: dict, runs: List[dict]) -> str:
    best = best_per_mode(runs)
    by_mode = {r["mode"]: r for r in best}
    peers = [p for p in (TRAINER_BASELINES if config.get("regime") == "uneven-trainer" else PEERS) if p in by_mode]
    head = ("| mode | best budget (steps) | seconds to target | tokens to target | "
            + "".join(f"vs {p} | " for p in peers) + "final val loss | link MB/rank/step |")
    # seconds/tokens to target are interpolated between validations; "(by step N)": the first
    # validation at or below the target
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in best:
        link = r["link_bytes_per_step"]
        reached = r["seconds_to_target"] is not None
        # ideal's W trainings each see 1/W of the batch: a pace, not a time to this target
        missed = "pace only | – | " if r["mode"] == "ideal" else "not reached | – | "
        rows.append(f"| {r['mode']} | {r['steps']} | "
                    + (f"{r['seconds_to_target']:.1f} (by step {r['step_to_target']}) | {r['tokens_to_target']:,} | "
                       if reached else missed)
                    + "".join(f"{_ratio(r, by_mode[p])} | " for p in peers)
                    + f"{r['val_loss']:.4f} | {_fmt(link / 1e6 if link is not None else None, '.3f')} |")
    at = lambda mode, steps: next((o for o in runs if o["mode"] == mode and o["steps"] == steps), None)
    head2 = ("| mode | steps | tokens/s | vs deepspeed | vs ideal | step s | exposed comm s/step | "
             "MB sent/rank/step | link MB/rank/step | final train loss | val loss | s to target | peak RSS MB |")
    rows2 = [head2, "|" + "---|" * (head2.count("|") - 1)]
    for r in runs:
        stock, ideal = at("deepspeed", r["steps"]), at("ideal", r["steps"])
        vs_stock = r["tokens_per_s"] / stock["tokens_per_s"] if stock else None
        vs_ideal = r["tokens_per_s"] / ideal["tokens_per_s"] if ideal else None
        mb, link = r["bytes_sent_per_rank_per_step"], r["link_bytes_per_step"]
        rows2.append(f"| {r['mode']} | {r['steps']} | {r['tokens_per_s']:,.0f} | {_fmt(vs_stock, '.2f', '×')} | "
                     f"{_fmt(vs_ideal, '.2f', '×')} | {r['step_time_s']:.3f} | "
                     f"{_fmt(r['exposed_comm_s_per_step'], '.3f')} | {_fmt(mb / 1e6 if mb is not None else None, '.3f')} | "
                     f"{_fmt(link / 1e6 if link is not None else None, '.3f')} | {r['final_train_loss']:.4f} | "
                     f"{r['val_loss']:.4f} | {_fmt(r['seconds_to_target'], '.1f')} | {_fmt(r['peak_rss_mb'], '.0f')} |")
    c = config
    target = (f"target val loss {c['target']:.4f} ({c['target_source']})" if c.get("target") is not None
              else "no target (no synchronous baseline run and no --target)")
    return (f"# ds_lowcomm bench\n\n{c['world_size']} ranks, model `{c['model']}`, budgets {c['budgets']} steps, "
            f"micro-batch {c['micro_batch']} × accumulation {c['gas']}, regime {c['regime'] or 'custom'}, link "
            f"{c['bandwidth'] or 'unlimited'}{' + ' + c['latency'] if c['latency'] else ''}"
            f"{' between 2 nodes' if c['regime'] == 'two-node' else ''}, "
            f"slow ranks: {c['slow_rank'] or 'none'}, "
            f"{'the Hugging Face Trainer (examples/finetune_hf.py), ' if c['regime'] == 'uneven-trainer' else ''}"
            f"medians over {c['repeat']} run(s); {target}; "
            f"validation every 1/{c['evals']} of a run, off the clock.\n\n"
            f"Command: `{c['command']}`\n\n"
            f"Time to target, each mode at its best budget (seconds of training; ratios < 1: faster than the peer):\n\n"
            + "\n".join(rows) + "\n\nEvery run:\n\n" + "\n".join(rows2) + "\n")


def plots(runs: List[dict], out: Path, target: Optional[float]) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed, no plots (pip install '.[bench]' or matplotlib)", flush=True)
        return []
    made = []
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in runs:
        vals = [x for x in r["records"] if "val_loss" in x]
        a.plot([x["train_s"] for x in vals], [x["val_loss"] for x in vals], marker=".",
               label=f"{r['mode']} ({r['steps']} steps)")
    # Best loss against wall time: per mode, the lowest val loss any of its budgets had reached
    # by then (the budget a user would have picked, knowing the answer).
    for mode in dict.fromkeys(r["mode"] for r in runs):
        pts = sorted((x["train_s"], x["val_loss"]) for r in runs if r["mode"] == mode
                     for x in r["records"] if "val_loss" in x)
        env, lo = [], float("inf")
        for t, v in pts:
            lo = min(lo, v)
            env.append((t, lo))
        b.step([t for t, _ in env], [v for _, v in env], where="post", label=mode)
    for ax, title in ((a, "val loss vs training time, every run"), (b, "best val loss over budgets vs time")):
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set(xlabel="training seconds (validation excluded)", ylabel="val loss", title=title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    made.append("loss.png")

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{r['mode']}@{r['steps']}" for r in runs]
    exposed = [r["exposed_comm_s_per_step"] or 0.0 for r in runs]
    total = [r["step_time_s"] for r in runs]
    a.bar(names, [t - e for t, e in zip(total, exposed)], label="compute (and hidden comm)")
    a.bar(names, exposed, bottom=[t - e for t, e in zip(total, exposed)], label="exposed comm")
    a.set(ylabel="seconds per step", title="time per step")
    a.legend()
    link = [max(r["link_bytes_per_step"] or r["bytes_sent_per_rank_per_step"] or 0, 1) for r in runs]
    b.bar(names, link)
    b.set_yscale("log")
    b.set(ylabel="bytes per rank per step (link, else accounting)", title="bytes per step (log)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_time_and_bytes.png", dpi=110)
    made.append("step_time_and_bytes.png")
    plt.close("all")
    return made


def _setting(text: str):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. demo.topk=8")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _budgets(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step counts, e.g. 100,200,400") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive step counts, e.g. 100,200,400")
    return sorted(set(values))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ds_lowcomm.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated, from: {', '.join(CONFIGS)} (default ideal,ddp,deepspeed,zero1,acco); "
                         f"--regime uneven-trainer: from {', '.join(TRAINER_CONFIGS)} (default all)")
    ap.add_argument("--regime", choices=REGIMES, default=None,
                    help="a preset link: fast, moderate, slow, uneven, two-node or uneven-trainer (see above)")
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default 2; 4 for two-node)")
    ap.add_argument("--bandwidth", default=None, help="e.g. 100mbit (tc rate syntax); default unlimited, "
                                                      "or the regime's calibrated rate")
    ap.add_argument("--latency", default=None, help="e.g. 5ms added one-way delay")
    ap.add_argument("--model", choices=list(MODELS), default="small")
    ap.add_argument("--steps", type=int, default=None,
                    help="the step budget (unless --budgets; default 60, --regime uneven-trainer "
                         f"{','.join(map(str, TRAINER_BUDGETS))})")
    ap.add_argument("--budgets", type=_budgets, default=None, metavar="N,N,...",
                    help="run every mode at each of these step budgets (schedule included); each "
                         "mode is reported at the one that reached the target soonest")
    ap.add_argument("--target", type=float, default=None,
                    help="target val loss (default: the synchronous baseline's final val loss)")
    ap.add_argument("--target-budget", type=int, default=None, metavar="N",
                    help="the default target is the baseline's final val loss at this budget (one of "
                         "--budgets) instead of its longest: every mode, the baseline included, still "
                         "runs at every budget, so the longer ones give slower methods room to reach it")
    ap.add_argument("--retarget", default=None, metavar="DIR",
                    help="run nothing: recompute a finished bench's time to target (--target or "
                         "--target-budget) from DIR's logs and rewrite its tables and plots")
    ap.add_argument("--evals", type=int, default=10, help="validations per run, at fixed steps")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--gas", type=int, default=4, help="gradient_accumulation_steps (even, for acco)")
    ap.add_argument("--comm-dtype", choices=["fp32", "bf16"], default=None)
    ap.add_argument("--data", default=None, help="text file (default: the built-in corpus)")
    ap.add_argument("--tokenizer", choices=["byte", "char"], default="byte")
    ap.add_argument("--eval-iters", type=int, default=10)
    ap.add_argument("--slow-rank", default=None, metavar="RANK:FACTOR[,...]",
                    help="uneven hardware: these ranks take FACTOR times as long per micro-batch")
    ap.add_argument("--acco-wait", action="store_true",
                    help="acco/dpu wait for the round in flight at each switch instead of computing more "
                         "micro-batches: exactly the tokens per step of zero1, for loss comparisons")
    ap.add_argument("--powersgd-rank", type=int, default=4, help="ddp-powersgd: matrix approximation rank")
    ap.add_argument("--powersgd-warmup", type=int, default=None,
                    help="ddp-powersgd: steps of plain all-reduce first (default: 10%% of the budget, "
                         "at least the LR warm-up, as PyTorch's docs advise)")
    ap.add_argument("--calibration-steps", type=int, default=6,
                    help="steps of the compute-only calibration run of moderate/slow/two-node")
    ap.add_argument("--set", action="append", default=[], type=_setting, metavar="KEY=VALUE",
                    help="override a \"lowcomm\" option, e.g. demo.topk=8 (JSON value; repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode; the table shows medians")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    trainer = args.regime == "uneven-trainer"
    known = TRAINER_CONFIGS if trainer else CONFIGS
    if args.modes is None:
        args.modes = ",".join(TRAINER_CONFIGS) if trainer else "ideal,ddp,deepspeed,zero1,acco"
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in known]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}{' under --regime uneven-trainer' if trainer else ''}; "
                 f"choose from {', '.join(known)}")
    args.budgets = args.budgets or ([args.steps] if args.steps else list(TRAINER_BUDGETS) if trainer else [60])
    if args.target_budget is not None and args.target is not None:
        ap.error("--target-budget picks the default target: give it or --target, not both")
    if args.target_budget is not None and not args.retarget and args.target_budget not in args.budgets:
        ap.error(f"--target-budget {args.target_budget} must be one of --budgets {args.budgets}")
    if args.evals < 1:
        ap.error(f"--evals: got {args.evals}; must be >= 1")
    if args.regime in ("uneven", "uneven-trainer") and args.slow_rank is None:
        args.slow_rank = "1:3"
    if args.world_size is None:
        args.world_size = 4 if args.regime == "two-node" else 2
    if args.regime == "two-node" and (args.world_size < 4 or args.world_size % 2):
        ap.error(f"--regime two-node: --world-size {args.world_size} must be even and >= 4 (2 nodes)")
    if args.regime in ("fast", "uneven", "uneven-trainer") and (args.bandwidth or args.latency):
        ap.error(f"--regime {args.regime} has no link limit; drop --bandwidth/--latency or pick another regime")
    if trainer and args.tokenizer != "byte":
        ap.error("--regime uneven-trainer: examples/finetune_hf.py tokenizes bytes only; drop --tokenizer")
    if not TRAIN.is_file() or (trainer and not FINETUNE.is_file()):
        ap.error(f"{TRAIN} not found: the bench runs examples/train.py with ds_configs/ of a source "
                 f"checkout; run it from the checkout's root (cd ds_lowcomm && python -m ds_lowcomm.bench)")
    return args


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


def main(argv=None) -> dict:
    args = parse_args(argv)
    command = "python -m ds_lowcomm.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.retarget:
        out = Path(args.retarget)
        config, results = reload_runs(out)
        config["command"] = f"{config['command']}, then {command}"
        return report(config, results, out, args.target, args.target_budget)
    _stop_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.regime in SYNC_STEPS and not args.bandwidth:
        args.bandwidth = calibrate(args, out)
    link = (TwoNodeLink if args.regime == "two-node" else Link)(args.bandwidth, args.latency)
    config = {k: getattr(args, k) for k in ("world_size", "bandwidth", "latency", "model", "budgets", "micro_batch",
                                           "gas", "comm_dtype", "data", "tokenizer", "slow_rank", "acco_wait",
                                           "set", "repeat", "seed", "regime", "evals", "powersgd_rank")}
    config.update(modes=args.mode_list, bandwidth=link.bandwidth, latency=link.latency, steps=max(args.budgets),
                  command=command)
    for mode in args.mode_list:
        if mode != "ideal":
            name = config_name(mode, args.regime)
            changed = VARIANTS.get(mode) or LOWCOMM_OPTIONS.get(mode)
            print(f"{mode}: " + (f"ds_configs/{name}" if name else "no DeepSpeed (the Trainer's DDP)")
                  + (f" with {changed}" if changed else "")
                  + (" without its \"lowcomm\" section" if args.regime == "uneven-trainer" and mode == "deepspeed"
                     else ""), flush=True)
    total = len(args.mode_list) * len(args.budgets) * args.repeat
    done, t_start, results = 0, time.monotonic(), []
    try:
        for steps in args.budgets:
            for mode in args.mode_list:
                runs = []
                for rep in range(args.repeat):
                    eta = ""
                    if done:
                        eta = f", ETA {(time.monotonic() - t_start) / done * (total - done) / 60:.1f} min"
                    print(f"[{done + 1}/{total}] {mode}, {steps} steps (run {rep + 1}/{args.repeat}{eta})", flush=True)
                    runs.append(run_one(args, mode, link, out, f"{mode}.{steps}.{rep}", steps))
                    done += 1
                results.append(summarize(mode, runs, link.bandwidth, steps))
    finally:
        link.close()
    return report(config, results, out, args.target, args.target_budget)


def report(config: dict, results: List[dict], out: Path, target: Optional[float],
           target_budget: Optional[int]) -> dict:
    """Time to target for every run, then results.json, results.md and the plots in ``out``."""
    config.pop("target", None)
    if target is not None:
        config.update(target=target, target_source="--target")
    elif (found := default_target(results, target_budget, TRAINER_BASELINES if config.get("regime") == "uneven-trainer"
                                  else BASELINES)) is not None:
        config.update(target=found[0], target_source=found[1])
    if config.get("target") is not None:
        apply_target(results, config["target"])
    drop = ("records", "all_records")
    payload = {"config": config, "runs": [{k: v for k, v in r.items() if k not in drop} for r in results],
               "best": [{k: v for k, v in r.items() if k not in drop} for r in best_per_mode(results)]}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    table = markdown(config, results)
    (out / "results.md").write_text(table)
    made = plots(results, out, config.get("target"))
    print("\n" + table, flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {out / m}" for m in made),
          flush=True)
    return payload


if __name__ == "__main__":
    main()
