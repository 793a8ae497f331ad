"""What a checkpoint costs, each ds_lowcomm mode beside stock DeepSpeed ZeRO-1, on a slow link.

    python -m ds_lowcomm.bench.checkpoint                       # GPT-2 of 29M params, 100 Mbit/s link
    python -m ds_lowcomm.bench.checkpoint --model tiny          # smoke run, a minute or two
    python -m ds_lowcomm.bench.checkpoint --bf16 --configs deepspeed,zero1 --out ckpt_bench

Runs from a checkout or an install (the configs ship in the package). For each config (stock
``deepspeed_zero1.json`` and the ds_lowcomm ``zero1``, ``acco``, ``demo``, ``desloc`` JSONs, their
``"lowcomm"`` sections kept, micro-batch and accumulation made small) it launches
``--world-size`` ranks with ``torch.distributed.run`` on the CPU (gloo), trains ``--steps`` steps
on random tokens, calls ``engine.save_checkpoint(dir)`` once, then builds a fresh engine (other
initial weights) and calls ``engine.load_checkpoint(dir)``. Per config it reports:

- save seconds: wall time of ``save_checkpoint``, started right after a barrier, max over ranks
  (the time training stands still);
- published seconds: until the checkpoint is complete and ``latest`` names it, max over ranks: the
  save seconds, or with ``--async-save`` (``lowcomm.async_save`` in the ds_lowcomm configs) until
  the background write is published (the bench waits for it without training);
- bytes on the link during the save: the loopback ``tx_bytes`` counter of the ranks' private
  network namespace, read before and after the save with barriers around (every rank's traffic,
  counted once; the same window without a save is measured too, as the floor);
- load seconds: wall time of ``load_checkpoint`` into the fresh engine, max over ranks;
- peak RSS in training (``VmHWM`` before the save) and peak RSS growth during the save
  (``VmHWM`` after the save, the high-water mark reset through ``/proc/self/clear_refs`` just
  before, minus ``VmRSS`` before), max over ranks;
- the checkpoint's size on disk and the files written.

``--bandwidth 100mbit`` (the default) runs the ranks in a private network namespace whose
loopback is limited by a token bucket (``ds_lowcomm.bench.link.Link``; needs root and iproute2, else
the run is unlimited on the host loopback and link bytes are not reported). ``--bandwidth none``
turns it off. Results go to ``results.json`` and ``results.md`` in ``--out`` (default: a fresh
directory under the system temp dir); checkpoints are deleted after measuring unless
``--keep-checkpoints``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from ds_lowcomm import configs
from ds_lowcomm.bench.link import Link, free_port
from ds_lowcomm.bench.runs import last_error, run_env

PROG = "python -m ds_lowcomm.bench.checkpoint"
CONFIGS = {"deepspeed": "deepspeed_zero1.json", "zero1": "zero1.json", "acco": "acco_zero1.json",
           "demo": "demo_zero1.json", "desloc": "desloc_zero1.json"}
STOCK = "deepspeed"
# name: (n_layer, n_head, n_embd, vocab_size, n_positions). "gpt2-29m" is the one the targets
# are stated for (>= 25M parameters, 29,060,096 with the tied head); the others are smoke sizes.
MODELS = {
    "tiny": (1, 2, 64, 256, 32),         # 68,544 parameters
    "small": (2, 4, 128, 1024, 64),      # 536,064
    "gpt2-29m": (4, 8, 512, 32000, 128),  # 29,060,096
}
RESULT_TAG = "BENCH_CHECKPOINT_RESULT "
MB = 1e6
ADAMW_STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per element of a shard
# tc's rate syntax (man tc: "RATES"); checked here so a typo fails before any namespace exists.
RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.I)


# -- per-rank worker ---------------------------------------------------------------------------------

def _proc_status(key: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _link_tx_bytes() -> int:
    # Inside `ip netns exec` /sys is remounted for the namespace: this is its own loopback.
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def _build_model(name: str, seed: int, bf16: bool):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_head, n_embd, vocab, n_pos = MODELS[name]
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_pos, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                     loss_type="ForCausalLM")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    # bf16: DeepSpeed casts the module itself; casting here too keeps both engines' init alike.
    return model.to(torch.bfloat16) if bf16 else model


def _weights_digest(module) -> list:
    """Per-parameter float64 sum and sum of squares: equal digests <=> (practically) equal weights,
    without a parameter-sized copy that would distort the load's memory numbers."""
    import torch

    with torch.no_grad():
        return [(float(p.double().sum()), float(p.double().square().sum())) for p in module.parameters()]


def worker(args) -> None:
    import torch
    import transformers  # noqa: F401  (imported before the RSS baseline below)

    import deepspeed
    import ds_lowcomm

    ds_lowcomm.skip_shm_comm_build()
    # RSS of the libraries alone (torch, DeepSpeed, transformers): "above imports" subtracts it.
    rss_imported = _proc_status("VmRSS")
    model = _build_model(args.model, args.seed, args.bf16)
    n_params = sum(p.numel() for p in model.parameters())
    # Only the engine is kept: the optimizer and scheduler are reachable from it (and die with it).
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.config)[0]
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, block = MODELS[args.model][3], MODELS[args.model][4]
    mbs = engine.train_micro_batch_size_per_gpu()

    # Train until the engine has taken --steps optimizer steps (under acco a rank may compute more
    # or fewer micro-batches per step than gradient_accumulation_steps, as in examples/train.py).
    t_train = time.perf_counter()
    step = engine.global_steps
    while step < args.steps:
        k = 0
        while engine.global_steps == step:
            g = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 1009 + k) * 4099 + rank)
            ids = torch.randint(0, vocab, (mbs, block), generator=g).to(engine.device)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            k += 1
        step = engine.global_steps
    train_s = time.perf_counter() - t_train
    if hasattr(engine, "comm_stats"):
        engine.optimizer.flush()  # no round in flight: the save measures the save, not a leftover round

    peak_train = _proc_status("VmHWM")
    ckpt = args.checkpoint_dir

    # The floor: the same barrier/read window with nothing in it (barrier and counter-read traffic).
    dist.barrier()
    tx0 = _link_tx_bytes()
    dist.barrier()
    dist.barrier()
    tx1 = _link_tx_bytes()
    dist.barrier()
    empty_window = tx1 - tx0

    # The save. Barriers around the counter reads: no rank's training traffic or result exchange
    # lands in the window, only the save's own (and the two barriers, measured above).
    dist.barrier()
    tx0 = _link_tx_bytes()
    rss_before = _proc_status("VmRSS")
    reset_ok = _reset_peak_rss()
    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(ckpt)
    save_s = time.perf_counter() - t0
    if hasattr(engine, "checkpointer"):
        engine.checkpointer.wait()  # an async save's background write: inside the RSS and link windows
    published_s = time.perf_counter() - t0
    peak_save = _proc_status("VmHWM")
    dist.barrier()
    tx1 = _link_tx_bytes()
    dist.barrier()
    save_link = tx1 - tx0

    digest_saved = _weights_digest(engine.module)
    if rank == 0:
        files = sorted((str(p.relative_to(ckpt)), p.stat().st_size) for p in Path(ckpt).rglob("*") if p.is_file())
    else:
        files = None

    # A fresh engine with other initial weights, the old one gone first (its memory is not the load's).
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model
    gc.collect()
    model = _build_model(args.model, args.seed + 1, args.bf16)
    # Only the engine is kept: the optimizer and scheduler are reachable from it (and die with it).
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.config)[0]
    digest_fresh = _weights_digest(engine.module)
    dist.barrier()
    rss_before_load = _proc_status("VmRSS")
    _reset_peak_rss()
    dist.barrier()
    t0 = time.perf_counter()
    engine.load_checkpoint(ckpt)
    load_s = time.perf_counter() - t0
    peak_load = _proc_status("VmHWM")
    digest_loaded = _weights_digest(engine.module)

    mine = {"rank": rank, "train_s": train_s, "save_s": save_s, "published_s": published_s, "load_s": load_s,
            "save_link_bytes": save_link, "empty_window_link_bytes": empty_window,
            "rss_imported": rss_imported, "peak_rss_train": peak_train,
            "rss_before_save": rss_before, "peak_rss_save": peak_save if reset_ok else None,
            "rss_before_load": rss_before_load, "peak_rss_load": peak_load if reset_ok else None,
            "weights_restored": digest_loaded == digest_saved, "weights_changed": digest_fresh != digest_saved}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        mode = engine.optimizer.mode_name if hasattr(engine, "comm_stats") else STOCK
        print(RESULT_TAG + json.dumps({"mode": mode, "world_size": world, "params": n_params,
                                       "steps": engine.global_steps, "files": files, "ranks": everyone}),
              flush=True)
    # Tear down in step: no rank may close its sockets while another is still in a collective.
    if hasattr(engine, "destroy"):
        engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


# -- parent: one launch per config ---------------------------------------------------------------------

def write_config(label: str, args, out: Path) -> Path:
    cfg = json.loads(Path(configs.path(CONFIGS[label])).read_text())
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg["gradient_accumulation_steps"] = args.gas
    if "scheduler" in cfg:
        cfg["scheduler"]["params"].update(total_num_steps=max(args.steps, 2), warmup_num_steps=1)
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if args.async_save and "lowcomm" in cfg:
        cfg["lowcomm"]["async_save"] = True
    path = out / "configs" / f"{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


def shard_group_size(label: str, world: int) -> int:
    """Ranks sharing one copy of the optimizer state (the world for stock, zero1, acco)."""
    section = json.loads(Path(configs.path(CONFIGS[label])).read_text()).get("lowcomm") or {}
    return section.get("shard_group_size") or world


def run_config(args, label: str, link: Link, out: Path, rep: int) -> dict:
    config = write_config(label, args, out)
    ckpt = out / "checkpoints" / f"{label}.{rep}"
    shutil.rmtree(ckpt, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
           "--master_port", str(free_port()), "-m", "ds_lowcomm.bench.checkpoint", "--worker",
           "--config", str(config), "--checkpoint-dir", str(ckpt), "--model", args.model,
           "--steps", str(args.steps), "--seed", str(args.seed)] + (["--bf16"] if args.bf16 else [])
    env = run_env("cpu")  # the worker imports the package it measures, as the bench's runs do
    log = out / "logs" / f"{label}.{rep}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        # Own session: a timeout ends the launcher and its ranks, and nothing else.
        proc = subprocess.Popen(link.prefix() + cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{label}: no result within --timeout {args.timeout} s; log: {log}")
    text = log.read_text()
    if proc.returncode != 0:
        why = last_error(text)
        raise RuntimeError(f"{label}: exited with {proc.returncode}{': ' + why if why else ''}; log: {log}\n"
                           f"{text[-3000:]}")
    lines = [l for l in text.splitlines() if l.startswith(RESULT_TAG)]
    if not lines:
        raise RuntimeError(f"{label}: no result line; log: {log}\n{text[-3000:]}")
    raw = json.loads(lines[-1][len(RESULT_TAG):])
    if not args.keep_checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)
    return raw


def summarize(label: str, raws: List[dict], isolated: bool) -> dict:
    """One row: maxima over ranks, medians over repeats."""
    def over_ranks(raw, key, f=max):
        values = [r[key] for r in raw["ranks"] if r[key] is not None]
        return f(values) if values else None

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def growth(raw, peak, before):
        values = [r[peak] - r[before] for r in raw["ranks"] if r[peak] is not None]
        return max(values) if values else None

    first = raws[0]
    params, world = first["params"], first["world_size"]
    files = first["files"]
    return {
        "config": CONFIGS[label], "label": label, "mode": first["mode"], "params": params, "world_size": world,
        "steps": first["steps"], "repeats": len(raws),
        "save_s": med([over_ranks(r, "save_s") for r in raws]),
        "published_s": med([over_ranks(r, "published_s") for r in raws]),
        # Loopback counts every rank's traffic once: rank 0's window is the whole namespace's.
        "save_link_bytes": med([r["ranks"][0]["save_link_bytes"] for r in raws]) if isolated else None,
        "empty_window_link_bytes": med([r["ranks"][0]["empty_window_link_bytes"] for r in raws]) if isolated else None,
        "load_s": med([over_ranks(r, "load_s") for r in raws]),
        "train_s": med([over_ranks(r, "train_s") for r in raws]),
        "peak_rss_train_bytes": med([over_ranks(r, "peak_rss_train") for r in raws]),
        "rss_imported_bytes": med([over_ranks(r, "rss_imported") for r in raws]),
        "rss_growth_save_bytes": med([growth(r, "peak_rss_save", "rss_before_save") for r in raws]),
        "rss_growth_load_bytes": med([growth(r, "peak_rss_load", "rss_before_load") for r in raws]),
        "checkpoint_bytes": sum(size for _, size in files),
        "files": files,
        "weights_restored": all(x["weights_restored"] for r in raws for x in r["ranks"]),
        "one_shard_optimizer_state_bytes": ADAMW_STATE_BYTES * params // shard_group_size(label, world),
    }


def _fmt(x, spec, scale=1.0, suffix=""):
    return "–" if x is None else format(x / scale, spec) + suffix


def markdown(meta: dict, rows: List[dict]) -> str:
    stock = next((r for r in rows if r["label"] == STOCK), None)
    head = ("| config | save s | save × stock | published s | MB on link during save | load s | peak RSS train MB | "
            "RSS growth at save MB | checkpoint MB on disk |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = r["save_s"] / stock["save_s"] if stock and stock["save_s"] else None
        name = f"{r['config']} (stock)" if r["label"] == STOCK else r["config"]
        lines.append(f"| {name} | {r['save_s']:.2f} | {_fmt(ratio, '.2f', suffix='×')} | {r['published_s']:.2f} | "
                     f"{_fmt(r['save_link_bytes'], '.3f', MB)} | {r['load_s']:.2f} | "
                     f"{_fmt(r['peak_rss_train_bytes'], ',.0f', MB)} | "
                     f"{_fmt(r['rss_growth_save_bytes'], ',.0f', MB)} | {r['checkpoint_bytes'] / MB:,.0f} |")
    p = rows[0]["params"]
    link = meta["bandwidth"] or "unlimited (no private namespace: link bytes not measured)"
    text = ["# ds_lowcomm checkpoint bench\n",
            f"{meta['world_size']} ranks (CPU, gloo), GPT-2 `{meta['model']}` ({p:,} parameters, "
            f"{'bf16' if meta['bf16'] else 'fp32'}), {meta['steps']} steps of micro-batch {meta['micro_batch']} × "
            f"accumulation {meta['gas']} before the save, link {link}, "
            f"{'async_save on' if meta['async_save'] else 'synchronous saves'}, medians over {meta['repeat']} run(s); "
            f"seconds and RSS are the max over ranks, MB = 10^6 bytes.\n",
            f"Command: `{meta['command']}`\n", "\n".join(lines), "",
            "Bytes per parameter (peak RSS in training / parameters; \"above imports\": minus the RSS after "
            "importing torch, DeepSpeed and transformers, before the model exists):\n",
            "| config | peak RSS train B/param | above imports B/param | RSS growth at save B/param | "
            "one shard of AdamW state B/param |", "|---|---|---|---|---|"]
    for r in rows:
        above = r["peak_rss_train_bytes"] - r["rss_imported_bytes"]
        text.append(f"| {r['config']} | {r['peak_rss_train_bytes'] / p:.1f} | {above / p:.1f} | "
                    f"{_fmt(r['rss_growth_save_bytes'], '.1f', p)} | {r['one_shard_optimizer_state_bytes'] / p:.1f} |")
    text += ["", "Files written per checkpoint (bytes):\n"]
    for r in rows:
        text.append(f"- {r['config']}: " + ", ".join(f"`{n}` {s:,}" for n, s in r["files"]))
    floor = [r["empty_window_link_bytes"] for r in rows if r["empty_window_link_bytes"] is not None]
    if floor:
        text.append(f"\nThe same barrier window with no save moved {max(floor):,} bytes at most (the floor "
                    f"included in \"MB on link during save\").")
    bad = [r["config"] for r in rows if not r["weights_restored"]]
    text.append("\nLoaded weights equal the saved ones in every config." if not bad else
                f"\nLoaded weights DIFFER from the saved ones in: {', '.join(bad)}.")
    return "\n".join(text) + "\n"


def targets(rows: List[dict]) -> List[str]:
    """The checkpoint targets: save <= 1.5x stock, <= 1 MB on the link, growth <= one shard."""
    stock = next((r for r in rows if r["label"] == STOCK), None)
    out = []
    for r in rows:
        if r["label"] == STOCK:
            continue
        checks = []
        if stock:
            ratio = r["save_s"] / stock["save_s"]
            checks.append(("save ≤ 1.5× stock", ratio <= 1.5, f"{ratio:.2f}×"))
        if r["save_link_bytes"] is not None:
            checks.append(("link ≤ 1 MB", r["save_link_bytes"] <= 1e6, f"{r['save_link_bytes'] / MB:.3f} MB"))
        if r["rss_growth_save_bytes"] is not None:
            shard = r["one_shard_optimizer_state_bytes"]
            checks.append(("RSS growth ≤ one shard", r["rss_growth_save_bytes"] <= shard,
                           f"{r['rss_growth_save_bytes'] / MB:.0f} of {shard / MB:.0f} MB"))
        out.append(f"{r['config']}: " + "; ".join(f"{name} {'PASS' if ok else 'FAIL'} ({v})"
                                                  for name, ok, v in checks))
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        sys.exit(f"{PROG}: error: {message} (see --help)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {value}; must be >= 1")
    return value


def parse_args(argv=None):
    ap = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all; "
                         f"'{STOCK}' is stock DeepSpeed ZeRO-1, the reference for 'save × stock')")
    ap.add_argument("--world-size", type=_positive, default=2, help="ranks (>= 2)")
    ap.add_argument("--bandwidth", default="100mbit", help="tc rate of the link, e.g. 100mbit; 'none': unlimited")
    ap.add_argument("--latency", default=None, help="added one-way delay, e.g. 5ms (netem)")
    ap.add_argument("--model", choices=list(MODELS), default="gpt2-29m",
                    help="GPT-2 size; tiny/small are for smoke runs")
    ap.add_argument("--bf16", action="store_true", help="bf16 model (default fp32)")
    ap.add_argument("--async-save", action="store_true",
                    help="lowcomm.async_save in the ds_lowcomm configs (stock DeepSpeed saves as always)")
    ap.add_argument("--steps", type=_positive, default=4, help="optimizer steps before the save")
    ap.add_argument("--micro-batch", type=_positive, default=1)
    ap.add_argument("--gas", type=_positive, default=2, help="gradient_accumulation_steps (even, for acco)")
    ap.add_argument("--repeat", type=_positive, default=1, help="runs per config; the table shows medians")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--timeout", type=_positive, default=1800, help="seconds per config run")
    ap.add_argument("--out", default=None, help="results directory (default: a fresh one under the temp dir)")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoint in --out")
    # The per-rank entry point, launched by torch.distributed.run (not for direct use).
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        if not args.config or not args.checkpoint_dir:
            ap.error("--worker needs --config and --checkpoint-dir (it is launched by the bench itself)")
        return args
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_list if c not in CONFIGS]
    if bad or not args.config_list:
        ap.error(f"--configs: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(CONFIGS)}")
    if len(set(args.config_list)) != len(args.config_list):
        ap.error("--configs: a config is listed twice")
    if args.world_size < 2:
        ap.error(f"--world-size {args.world_size}: a checkpoint of sharded state needs >= 2 ranks")
    if args.gas % 2 and "acco" in args.config_list:
        ap.error(f"--gas {args.gas}: acco splits each step into two rounds, use an even number")
    if args.bandwidth.lower() in ("none", "unlimited", "0", ""):
        args.bandwidth = None
    elif not RATE.match(args.bandwidth):
        ap.error(f"--bandwidth {args.bandwidth!r}: expected a tc rate such as 100mbit, 1gbit, 12mbps, or 'none'")
    if args.latency is not None and not re.match(r"^\d+(\.\d+)?(s|ms|us)$", args.latency):
        ap.error(f"--latency {args.latency!r}: expected a delay such as 5ms")
    return args


def main(argv=None) -> Optional[dict]:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ds_lowcomm_ckpt_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    link = Link(args.bandwidth, args.latency)
    isolated = link.ns is not None
    meta = {k: getattr(args, k) for k in ("world_size", "model", "bf16", "steps", "micro_batch", "gas",
                                           "repeat", "seed", "async_save")}
    meta.update(configs=args.config_list, bandwidth=link.bandwidth, latency=link.latency,
                command=f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]))
    total, done, t_start, rows, all_raws = len(args.config_list) * args.repeat, 0, time.monotonic(), [], {}
    try:
        for label in args.config_list:
            raws = []
            for rep in range(args.repeat):
                eta = f", ETA {(time.monotonic() - t_start) / done * (total - done) / 60:.1f} min" if done else ""
                print(f"[{done + 1}/{total}] {CONFIGS[label]} (run {rep + 1}/{args.repeat}{eta})", flush=True)
                raws.append(run_config(args, label, link, out, rep))
                r = raws[-1]
                print(f"  save {max(x['save_s'] for x in r['ranks']):.2f} s | "
                      f"published {max(x['published_s'] for x in r['ranks']):.2f} s | "
                      f"load {max(x['load_s'] for x in r['ranks']):.2f} s"
                      + (f" | {r['ranks'][0]['save_link_bytes'] / MB:.3f} MB on the link" if isolated else ""),
                      flush=True)
                done += 1
            rows.append(summarize(label, raws, isolated))
            all_raws[label] = raws  # per rank, per repeat: what the medians were taken over
    finally:
        link.close()
    payload = {"config": meta, "results": rows, "runs": all_raws}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    table = markdown(meta, rows)
    checks = targets(rows)
    if checks:
        table += "\nTargets:\n\n" + "\n".join(f"- {c}" for c in checks) + "\n"
    (out / "results.md").write_text(table)
    print("\n" + table, flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}", flush=True)
    return payload


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as err:
        sys.exit(f"{PROG}: {err}")
