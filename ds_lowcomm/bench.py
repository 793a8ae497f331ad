"""Every mode side by side on one (optionally bandwidth-limited) link: ``python -m ds_lowcomm.bench``.

Runs ``examples/train.py`` with the same model, data, seed and step budget under each of
``--modes`` and writes ``results.json``, ``results.md`` and plots into ``--out``:

- ``ideal``: the same per-rank work with no communication at all: W independent single-rank
  trainings at once on the same machine (the physical limit);
- ``deepspeed``: stock DeepSpeed ZeRO-1 (``ds_configs/deepspeed_zero1.json``);
- ``zero1``, ``acco``, ``dpu``: ds_lowcomm modes (``ds_configs/<mode>*.json``).

``--bandwidth 100mbit`` runs all ranks in a private network namespace whose loopback is limited by
a token bucket (``tc ... tbf``; ``--latency`` adds netem delay), like a slow shared link. It needs
root; otherwise the bench says so and runs unlimited. Bytes are reported twice: the library's
accounting and the namespace's interface counters (what really crossed the link).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
CONFIGS = {"ideal": "zero1.json", "deepspeed": "deepspeed_zero1.json", "zero1": "zero1.json",
           "acco": "acco_zero1.json", "dpu": "dpu_zero1.json", "demo": "demo_zero1.json",
           "desloc": "desloc_zero1.json"}
MODELS = {  # name: (n_layer, n_head, n_embd, block_size)
    "tiny": (1, 2, 32, 32),
    "small": (4, 4, 128, 128),
    "base": (6, 6, 384, 256),
}
RUN_KEYS = ("mode", "world_size", "bandwidth", "tokens_per_s", "step_time_s", "exposed_comm_s_per_step",
            "bytes_sent_per_rank_per_step", "bytes_received_per_rank_per_step", "link_bytes_per_step",
            "final_train_loss", "val_loss", "peak_rss_mb", "tokens", "steps")


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

    def prefix(self) -> List[str]:
        return ["ip", "netns", "exec", self.ns] if self.ns else []

    def close(self) -> None:
        if self.ns:
            subprocess.run(["ip", "netns", "del", self.ns], check=False)
            self.ns = None


def write_config(mode: str, args, out: Path) -> Path:
    cfg = json.loads((ROOT / "ds_configs" / CONFIGS[mode]).read_text())
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg["gradient_accumulation_steps"] = args.gas
    if "scheduler" in cfg:
        cfg["scheduler"]["params"].update(total_num_steps=args.steps,
                                          warmup_num_steps=max(1, args.steps // 10))
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
    path = out / "configs" / f"{mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


def train_command(args, config: Path, nproc: int, log_json: Path, slow: str, link: "Link") -> List[str]:
    n_layer, n_head, n_embd, block = MODELS[args.model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(TRAIN), "--deepspeed", str(config),
           "--max-steps", str(args.steps), "--eval-every", "0", "--eval-iters", str(args.eval_iters),
           "--log-every", str(max(1, args.steps // 20)), "--seed", str(args.seed),
           "--n-layer", str(n_layer), "--n-head", str(n_head), "--n-embd", str(n_embd),
           "--block-size", str(block), "--tokenizer", args.tokenizer, "--log-json", str(log_json)]
    if link.ns:  # the interface counters only mean something in our private namespace
        cmd.append("--link-counter")
    if args.data:
        cmd += ["--data", args.data]
    if slow:
        cmd += ["--slow-ranks", slow]
    return cmd


def run_one(args, mode: str, link: Link, out: Path, label: str) -> dict:
    """One training; returns its result JSON (plus the per-step records)."""
    config = write_config(mode, args, out)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    if mode == "ideal":
        # W single-rank trainings at once: same per-rank work and machine load, no communication.
        # A slowed rank keeps its slowdown.
        slow = dict(p.split(":") for p in args.slow_rank.split(",") if p) if args.slow_rank else {}
        procs = []
        for r in range(args.world_size):
            log_json = logs / f"{label}.rank{r}.jsonl"
            log_json.unlink(missing_ok=True)
            cmd = train_command(args, config, 1, log_json, f"0:{slow[str(r)]}" if str(r) in slow else "", link)
            procs.append(subprocess.Popen(link.prefix() + cmd, env=env, stdout=subprocess.PIPE,
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
                      comm_wait_s_per_step=0.0, link_bytes_per_rank_per_step=None)
        # Rank 0's curve, its tokens scaled to all W trainings (they run at the same pace).
        result["records"] = [dict(r, tokens=r["tokens"] * args.world_size) if "tokens" in r else r
                             for r in _records(logs / f"{label}.rank0.jsonl")]
        return result
    log_json = logs / f"{label}.jsonl"
    log_json.unlink(missing_ok=True)
    cmd = train_command(args, config, args.world_size, log_json, args.slow_rank or "", link)
    proc = subprocess.Popen(link.prefix() + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    text = _follow(proc, label)
    (logs / f"{label}.log").write_text(text)
    result = _result(text, label)
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


def summarize(mode: str, runs: List[dict], bandwidth: Optional[str]) -> dict:
    """Medians over repeats, in the results.json schema."""
    def med(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    link = med("link_bytes_per_rank_per_step")
    return {"mode": mode, "world_size": runs[0]["world_size"], "bandwidth": bandwidth,
            "tokens_per_s": med("tokens_per_s"), "step_time_s": med("step_time_s"),
            "exposed_comm_s_per_step": med("comm_wait_s_per_step"),
            "bytes_sent_per_rank_per_step": med("bytes_sent_per_rank_per_step"),
            "bytes_received_per_rank_per_step": med("bytes_received_per_rank_per_step"),
            "link_bytes_per_step": link,
            "final_train_loss": med("final_train_loss"), "val_loss": med("val_loss"),
            "peak_rss_mb": med("peak_rss_mb"), "tokens": int(med("tokens")), "steps": runs[0]["steps"],
            "repeats": len(runs), "micro_batches_per_round": med("micro_batches_per_round"),
            "records": runs[len(runs) // 2]["records"]}


def _fmt(x, spec, unit=""):
    return "–" if x is None else format(x, spec) + unit


def markdown(config: dict, runs: List[dict]) -> str:
    ideal = next((r for r in runs if r["mode"] == "ideal"), None)
    stock = next((r for r in runs if r["mode"] == "deepspeed"), None)
    head = ("| mode | tokens/s | vs deepspeed | vs ideal | step s | exposed comm s/step | "
            "MB sent/rank/step | link MB/rank/step | final train loss | val loss | peak RSS MB |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        vs_stock = r["tokens_per_s"] / stock["tokens_per_s"] if stock else None
        vs_ideal = r["tokens_per_s"] / ideal["tokens_per_s"] if ideal else None
        mb = r["bytes_sent_per_rank_per_step"]
        link = r["link_bytes_per_step"]
        rows.append(f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {_fmt(vs_stock, '.2f', '×')} | "
                    f"{_fmt(vs_ideal, '.2f', '×')} | {r['step_time_s']:.3f} | "
                    f"{_fmt(r['exposed_comm_s_per_step'], '.3f')} | {_fmt(mb / 1e6 if mb is not None else None, '.3f')} | "
                    f"{_fmt(link / 1e6 if link is not None else None, '.3f')} | {r['final_train_loss']:.4f} | "
                    f"{r['val_loss']:.4f} | {_fmt(r['peak_rss_mb'], '.0f')} |")
    c = config
    return (f"# ds_lowcomm bench\n\n{c['world_size']} ranks, model `{c['model']}`, {c['steps']} steps, "
            f"micro-batch {c['micro_batch']} × accumulation {c['gas']}, link "
            f"{c['bandwidth'] or 'unlimited'}{' + ' + c['latency'] if c['latency'] else ''}, "
            f"slow ranks: {c['slow_rank'] or 'none'}, medians over {c['repeat']} run(s).\n\n"
            f"Command: `{c['command']}`\n\n" + "\n".join(rows) + "\n")


def plots(runs: List[dict], out: Path) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed, no plots (pip install matplotlib)", flush=True)
        return []
    made = []
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        rec = [x for x in r["records"] if "loss" in x]
        a.plot([x["tokens"] for x in rec], [x["loss"] for x in rec], label=r["mode"])
        b.plot([x["train_s"] for x in rec], [x["loss"] for x in rec], label=r["mode"])
    a.set(xlabel="tokens (this rank's pace × world)", ylabel="train loss", title="loss vs tokens")
    b.set(xlabel="training seconds", ylabel="train loss", title="loss vs wall time")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    made.append("loss.png")

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["mode"] for r in runs]
    exposed = [r["exposed_comm_s_per_step"] or 0.0 for r in runs]
    total = [r["step_time_s"] for r in runs]
    a.bar(names, [t - e for t, e in zip(total, exposed)], label="compute (and hidden comm)")
    a.bar(names, exposed, bottom=[t - e for t, e in zip(total, exposed)], label="exposed comm")
    a.set(ylabel="seconds per step", title="time per step")
    a.legend()
    sent = [max(r["bytes_sent_per_rank_per_step"] or 0, 1) for r in runs]
    b.bar(names, sent)
    b.set_yscale("log")
    b.set(ylabel="bytes sent per rank per step", title="bytes per step (log)")
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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ds_lowcomm.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="ideal,deepspeed,zero1,acco",
                    help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--bandwidth", default=None, help="e.g. 100mbit (tc rate syntax); default unlimited")
    ap.add_argument("--latency", default=None, help="e.g. 5ms added one-way delay")
    ap.add_argument("--model", choices=list(MODELS), default="small")
    ap.add_argument("--steps", type=int, default=60)
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
    ap.add_argument("--set", action="append", default=[], type=_setting, metavar="KEY=VALUE",
                    help="override a \"lowcomm\" option, e.g. demo.topk=8 (JSON value; repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode; the table shows medians")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in CONFIGS]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(CONFIGS)}")
    if not TRAIN.is_file():
        ap.error(f"{TRAIN} not found: the bench runs examples/train.py with ds_configs/ of a source "
                 f"checkout; run it from the checkout's root (cd ds_lowcomm && python -m ds_lowcomm.bench)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    link = Link(args.bandwidth, args.latency)
    config = {k: getattr(args, k) for k in ("world_size", "bandwidth", "latency", "model", "steps", "micro_batch",
                                           "gas", "comm_dtype", "data", "tokenizer", "slow_rank", "acco_wait", "set", "repeat", "seed")}
    config.update(modes=args.mode_list, bandwidth=link.bandwidth, latency=link.latency,
                  command="python -m ds_lowcomm.bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    total = len(args.mode_list) * args.repeat
    done, t_start, results = 0, time.monotonic(), []
    try:
        for mode in args.mode_list:
            runs = []
            for rep in range(args.repeat):
                eta = ""
                if done:
                    eta = f", ETA {(time.monotonic() - t_start) / done * (total - done) / 60:.1f} min"
                print(f"[{done + 1}/{total}] {mode} (run {rep + 1}/{args.repeat}{eta})", flush=True)
                runs.append(run_one(args, mode, link, out, f"{mode}.{rep}"))
                done += 1
            results.append(summarize(mode, runs, link.bandwidth))
    finally:
        link.close()
    payload = {"config": config, "runs": [{k: v for k, v in r.items() if k != "records"} for r in results]}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    table = markdown(config, results)
    (out / "results.md").write_text(table)
    made = plots(results, out)
    print("\n" + table, flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {out / m}" for m in made),
          flush=True)
    return payload


if __name__ == "__main__":
    main()
