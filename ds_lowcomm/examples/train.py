"""Train a small GPT-style causal LM with DeepSpeed, optionally under a ds_lowcomm mode.

    deepspeed --num_gpus 2 examples/train.py --deepspeed ds_configs/zero1.json
    torchrun --nproc_per_node 2 examples/train.py --deepspeed ds_configs/zero1.json

On a CPU-only machine prefix ``DS_ACCELERATOR=cpu`` (the deepspeed launcher then takes
``--num_accelerators 2`` instead of ``--num_gpus 2``). Without ``--data`` it trains on Python's own
documentation (the text ``help()`` shows, shipped with every Python in ``pydoc_data``), byte-level,
so it runs anywhere with no download. The last line on stdout is one JSON object with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, also under python -m
import deepspeed  # noqa: E402
import hjson  # noqa: E402
import ds_lowcomm  # noqa: E402  (patches deepspeed.initialize: a "lowcomm" JSON section takes effect)
from ds_lowcomm.integration.preemption import PreemptionGuard  # noqa: E402
from common import at_least, dropout, fraction, host_group, max_over_ranks, mean_over_ranks, parse_slow_ranks, slow_down, slow_factor


# -- data -----------------------------------------------------------------------------------------

def builtin_corpus() -> str:
    """Python's documentation topics (``pydoc_data.topics``): ~460 KB of English prose and code."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def read_corpus(path: str | None) -> tuple[str, str]:
    if path is None:
        return builtin_corpus(), "python-docs (built in)"
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".md", ".rst"))
        if not files:
            sys.exit(f"error: --data {path}: no .txt/.md/.rst files in that directory")
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files), str(p)
    if not p.is_file():
        sys.exit(f"error: --data {path}: no such file or directory")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        sys.exit(f"error: --data {path}: the file is empty")
    return text, str(p)


class Tokenizer:
    """``byte``: UTF-8 bytes, vocabulary 256. ``char``: the corpus's characters, sorted."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind = kind
        if kind == "byte":
            self.vocab_size = 256
        else:
            self.chars = sorted(set(text))
            self.index = {c: i for i, c in enumerate(self.chars)}
            self.vocab_size = len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        if self.kind == "byte":
            return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)


def micro_batch_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """One micro-batch's seed: its training windows take it from ``seed``, its dropout masks from
    ``seed + 2`` and validation's windows from ``seed + 1`` (the call sites say why)."""
    return ((seed * 1_000_003 + step) * 1009 + micro) * 4099 + rank


def sample_batch(tokens: torch.Tensor, seed: int, step: int, micro: int, rank: int, mbs: int,
                 block: int) -> torch.Tensor:
    """Random windows; a pure function of (seed, step, micro-batch, rank) so resume is exact."""
    g = torch.Generator().manual_seed(micro_batch_seed(seed, step, micro, rank))
    starts = torch.randint(0, len(tokens) - block - 1, (mbs,), generator=g)
    return torch.stack([tokens[s: s + block + 1] for s in starts.tolist()])


def to_device(batch: torch.Tensor, device) -> torch.Tensor:
    """``batch`` on ``device``. On CUDA from pinned memory without blocking: a copy from pageable
    memory makes the host wait until the GPU has reached it, every micro-batch."""
    device = torch.device(device)
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


# -- arguments ------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # `--deepspeed PATH` (what users type, as with the HF Trainer) and DeepSpeed's own
    # `--deepspeed --deepspeed_config PATH` both work.
    ap.add_argument("--deepspeed", nargs="?", const=True, default=None, metavar="CONFIG",
                    help="DeepSpeed JSON config (or a bare flag together with --deepspeed_config)")
    ap.add_argument("--deepspeed_config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                    help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help="text file or directory (default: built-in Python docs)")
    ap.add_argument("--tokenizer", choices=["byte", "char"], default="byte")
    ap.add_argument("--n-layer", type=at_least(int, 1), default=4)
    ap.add_argument("--n-head", type=at_least(int, 1), default=4)
    ap.add_argument("--n-embd", type=at_least(int, 1), default=128)
    ap.add_argument("--block-size", type=at_least(int, 1), default=128)
    ap.add_argument("--dropout", type=dropout, default=0.0)
    ap.add_argument("--max-steps", type=at_least(int, 1), default=200, help="optimizer steps")
    ap.add_argument("--eval-every", type=at_least(int, 0), default=50, help="steps between validation runs (0: end only)")
    ap.add_argument("--eval-iters", type=at_least(int, 1), default=10, help="micro-batches per rank per validation")
    ap.add_argument("--val-fraction", type=fraction, default=0.1, help="tail of the corpus held out")
    ap.add_argument("--log-every", type=at_least(int, 1), default=10)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--save-dir", default=None, help="checkpoint directory")
    ap.add_argument("--save-every", type=at_least(int, 0), default=0, help="steps between checkpoints (0: end only)")
    ap.add_argument("--resume", nargs="?", const="latest", choices=["latest", "auto"], default=None,
                    help="resume from the latest checkpoint in --save-dir (an error if there is none); "
                         "'--resume auto': resume if there is one, else start fresh (one command line for "
                         "the first start and every restart)")
    ap.add_argument("--log-json", default=None, metavar="FILE",
                    help="rank 0 appends one JSON record per logged step, each flushed as it is written (for plots)")
    ap.add_argument("--link-counter", action="store_true",
                    help="report bytes that crossed the loopback interface during training (meaningful "
                         "only in a private network namespace, as ds_lowcomm.bench runs it)")
    ap.add_argument("--slow-ranks", type=parse_slow_ranks, default={}, metavar="RANK:FACTOR[,...]",
                    help="emulate uneven hardware: these ranks' model runs FACTOR times as long (examples/common.py)")
    args = ap.parse_args(argv)
    if args.deepspeed is True or args.deepspeed is None:
        args.deepspeed = args.deepspeed_config
    if not args.deepspeed:
        ap.error("a DeepSpeed config is required: --deepspeed ds_configs/zero1.json (or a shipped name: zero1)")
    if args.resume and not args.save_dir:
        ap.error("--resume needs --save-dir")
    if args.n_embd % args.n_head:
        ap.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    return args


# -- training -------------------------------------------------------------------------------------

def build_model(args, vocab_size: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab_size, n_positions=args.block_size, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=args.dropout,
                     embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0,
                     loss_type="ForCausalLM")
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(cfg)


def read_link_bytes() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


class ByteMeter:
    """Bytes each rank sends/receives per step: ds_lowcomm's counters, or DeepSpeed's comms logger."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.start = engine.global_steps  # after a resume: the counters start with this process

    def per_step(self):
        if hasattr(self.engine, "comm_stats"):
            s = self.engine.comm_stats()
            return s["bytes_sent_per_step"], s["bytes_received_per_step"], s["exposed_comm_s_per_step"]
        from deepspeed.comm.comm import comms_logger

        steps = self.engine.global_steps - self.start
        if not comms_logger.enabled or not steps:
            return None, None, None
        from ds_lowcomm.comm.collectives import deepspeed_logged_bytes

        sent, recv = deepspeed_logged_bytes(comms_logger.comms_dict, torch.distributed.get_world_size())
        return sent / steps, recv / steps, None

    def micro_batches_per_round(self):
        """This rank's recent average (acco): fewer on a slow rank, more on a fast one."""
        if hasattr(self.engine, "comm_stats"):
            return self.engine.comm_stats().get("micro_batches_per_round")
        return None


@torch.no_grad()
def evaluate(engine, tokens, args, rank, mbs, step, group) -> float:
    engine.eval()
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i in range(args.eval_iters):
        xy = to_device(sample_batch(tokens, args.seed + 1, step, i, rank, mbs, args.block_size), engine.device)
        total += engine(xy[:, :-1], labels=xy[:, :-1]).loss.detach()
    engine.train()
    return mean_over_ranks(total.item() / args.eval_iters, group)


def load_config(args) -> dict:
    """The ``--deepspeed`` config (a path, or a shipped config's name: :mod:`ds_lowcomm.configs`;
    JSON or hjson, as DeepSpeed reads it). A LR schedule that spans another number of steps than
    ``--max-steps`` is left as it is (a run may be resumed later with a higher ``--max-steps``, and
    the checkpoint keeps only the schedule's position) and named in one line."""
    try:
        args.deepspeed = ds_lowcomm.configs.resolve(args.deepspeed)
    except FileNotFoundError as err:
        sys.exit(f"error: --deepspeed: {err}")
    with open(args.deepspeed) as f:
        config = hjson.load(f)
    params = config.get("scheduler", {}).get("params", {})
    total = params.get("total_num_steps")
    if total is not None and total != args.max_steps and os.environ.get("RANK", "0") == "0":
        print(f"note: the LR schedule of {args.deepspeed} spans {total} steps (warm-up "
              f"{params.get('warmup_num_steps', 'default')}) and --max-steps is {args.max_steps}: the run "
              f"{'stops before its schedule ends' if total > args.max_steps else 'goes on past its schedule'}; "
              f"set scheduler.params.total_num_steps to {args.max_steps} for a schedule that spans the run",
              flush=True)
    return config


def deepspeed_engine(args, model):
    """The engine this script trains with: ``deepspeed.initialize`` on the ``--deepspeed`` JSON
    (with a ``"lowcomm"`` section, a ds_lowcomm engine)."""
    try:
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=load_config(args))[0]
    except ds_lowcomm.LowCommConfigError as err:
        sys.exit(f"error: {args.deepspeed}: {err}")
    except AssertionError as err:  # DeepSpeed checks its own config with asserts
        sys.exit(f"error: {args.deepspeed}: DeepSpeed refused the config: {err}")


def stop(engine, message: str, code: int = 1) -> None:
    """Exit with ``message`` (one line on stderr, rank 0's only when ``code`` is not 1) and
    ``code``, every rank alike: the engine and the process group torn down first, so no rank dies
    in a destructor (gloo aborts a process that exits with its group alive) while another still
    waits."""
    rank = torch.distributed.get_rank()
    engine.destroy()
    torch.distributed.destroy_process_group()
    if code == 1:
        sys.exit(message)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def main(argv=None, make_engine=deepspeed_engine, args=None) -> dict:
    """Train; returns the result dict also printed as the last stdout line. ``make_engine(args,
    model)`` builds the engine (``examples/train_ddp.py`` passes a DDP one); ``args`` already
    parsed, if given."""
    args = args or parse_args(argv)
    ds_lowcomm.skip_shm_comm_build()
    text, source = read_corpus(args.data)
    tok = Tokenizer(args.tokenizer, text)
    tokens = tok.encode(text)
    n_val = int(len(tokens) * args.val_fraction)
    train_tokens, val_tokens = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
    for part, n, fix in (("training", len(train_tokens), "lower --val-fraction"),
                         ("validation", len(val_tokens), "raise --val-fraction")):
        if n <= args.block_size + 1:
            sys.exit(f"error: the {part} part of the corpus has {n} tokens, too few for --block-size "
                     f"{args.block_size} (needs more than {args.block_size + 1}): {fix}, lower "
                     f"--block-size, or give more --data")

    model = build_model(args, tok.vocab_size)
    engine = make_engine(args, model)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    host = host_group()
    mode = engine.optimizer.mode_name if hasattr(engine, "comm_stats") else getattr(engine, "name", "deepspeed")
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = mbs * gas * world * args.block_size
    say = print if rank == 0 else (lambda *a, **k: None)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"mode {mode} | {world} ranks | {n_params / 1e6:.2f}M params | data {source}: "
        f"{len(train_tokens):,} train / {len(val_tokens):,} val {args.tokenizer} tokens | "
        f"{tokens_per_step:,} tokens/step (micro-batch {mbs} x accumulation {gas} x {world} ranks)",
        flush=True)

    # SIGTERM / SIGUSR1: finish the step, save, exit 128 + the signal (lowcomm.save_on_preemption).
    save_on_preemption = getattr(getattr(engine, "lowcomm_config", None), "save_on_preemption", True)
    guard = PreemptionGuard(host) if hasattr(engine, "save_checkpoint") and save_on_preemption else None

    # What the run's earlier processes trained (from a resume's checkpoint): seconds and tokens
    start, before = engine.global_steps, {"train_s": 0.0, "tokens": 0}
    if args.resume == "auto" and not os.path.isfile(os.path.join(args.save_dir, "latest")):
        say(f"--resume auto: no checkpoint in {args.save_dir} yet; starting fresh", flush=True)
    elif args.resume:
        try:
            _, client = engine.load_checkpoint(args.save_dir)
        except ds_lowcomm.CheckpointError as err:  # every rank gets the same verdict
            stop(engine, f"error: --resume: {err}")
        if client is None:  # stock DeepSpeed only warns when there is no checkpoint
            stop(engine, f"error: --resume: no checkpoint found in {args.save_dir}")
        start = engine.global_steps
        # (a checkpoint saved before train.py kept them: no seconds, the steps' tokens at this size)
        before = {"train_s": client.get("train_s", 0.0), "tokens": client.get("tokens", start * tokens_per_step)}
        if start >= args.max_steps:
            stop(engine, f"error: --resume: the checkpoint in {args.save_dir} is at step {start}, not before "
                         f"--max-steps {args.max_steps}; raise --max-steps to train further")
        say(f"resumed from {args.save_dir} at step {start}", flush=True)

    meter = ByteMeter(engine)
    slow = slow_factor(args.slow_ranks, rank, world)
    slow_down(engine.module, slow)
    if slow != 1.0:
        print(f"rank {rank}: slowed down {slow:g}x (--slow-ranks)", flush=True)
    losses, train_time, micro_batches = [], 0.0, 0
    # line-buffered: each record is flushed when written (follow a long run; a killed run keeps its log)
    records = open(args.log_json, "a", buffering=1) if (args.log_json and rank == 0) else None

    def run_so_far() -> dict:
        """The whole run's training seconds and tokens (rank 0's), earlier processes included: a
        resumed run's records and checkpoints go on from where the last process's stopped."""
        return {"train_s": before["train_s"] + train_time,
                "tokens": before["tokens"] + micro_batches * mbs * args.block_size * world}

    def record(**fields):
        """One --log-json record (rank 0)."""
        if records:
            records.write(json.dumps({"step": engine.global_steps, **fields, **run_so_far()}) + "\n")

    link_start = read_link_bytes() if args.link_counter else None
    step = engine.global_steps
    while step < args.max_steps:
        # One optimizer step: micro-batches until the engine has applied an update. That is
        # gradient_accumulation_steps of them in synchronous modes; under acco a rank computes as
        # many as fit while communication is in flight.
        t0 = time.perf_counter()
        # The loss stays on the device until the step is logged: a .item() per micro-batch would
        # make the host wait for every kernel and take away the GPU's overlap with communication.
        total, k = torch.zeros((), dtype=torch.float64, device=engine.device), 0
        while engine.global_steps == step:
            xy = to_device(sample_batch(train_tokens, args.seed, step, k, rank, mbs, args.block_size), engine.device)
            # Dropout draws from torch's global generator, which no checkpoint keeps (DeepSpeed
            # 0.19.8 saves no RNG state): seeded per micro-batch, its masks are a function of the
            # step like the data, and a resumed run draws the ones the uninterrupted run drew. Its
            # seed is not the windows' (seed + 2; validation's windows take seed + 1): the CPU
            # generator keeps a seed's low 32 bits, so the same seed would replay their numbers.
            torch.manual_seed(micro_batch_seed(args.seed + 2, step, k, rank))
            loss = engine(xy[:, :-1], labels=xy[:, :-1]).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
            k += 1
            micro_batches += 1
        train_time += time.perf_counter() - t0
        losses.append(total / k)  # a device scalar, read when logged
        step = done = engine.global_steps
        if done % args.log_every == 0 or done == args.max_steps:
            losses[-1] = float(losses[-1])
            sent, _, wait = meter.per_step()
            tps = micro_batches * mbs * args.block_size * world / train_time  # rank 0's pace
            extra = f" | sent {sent / 1e6:.3f} MB/step" if sent is not None else ""
            extra += f" | comm wait {wait * 1e3:.1f} ms/step" if wait is not None else ""
            per_round = meter.micro_batches_per_round()
            extra += f" | {per_round:.2f} micro-batches/round" if per_round else ""
            extra += f" | {engine.skipped_steps} steps skipped (non-finite)" if engine.skipped_steps else ""
            say(f"step {done}/{args.max_steps} | loss {losses[-1]:.4f} | "
                f"lr {engine.get_lr()[0]:.2e} | {tps:,.0f} tok/s{extra}", flush=True)
            if slow != 1.0 and per_round:
                print(f"  rank {rank} (slowed {slow:g}x): {per_round:.2f} micro-batches/round", flush=True)
            record(loss=float(losses[-1]))
        if args.eval_every and done % args.eval_every == 0 and done != args.max_steps:
            vl = evaluate(engine, val_tokens, args, rank, mbs, done, host)  # not on the training clock
            say(f"step {done}: val loss {vl:.4f}", flush=True)
            record(val_loss=vl)
        saved = args.save_dir and ((args.save_every and done % args.save_every == 0) or done == args.max_steps)
        if saved:
            engine.save_checkpoint(args.save_dir, client_state={"step": done, **run_so_far()})
            say(f"step {done}: saved checkpoint to {args.save_dir}", flush=True)
        if guard is not None and guard.poll() and done != args.max_steps:
            if args.save_dir and not saved:
                engine.save_checkpoint(args.save_dir, client_state={"step": done, **run_so_far()})
            where = f"saved step {done} to {args.save_dir}" if args.save_dir else "no --save-dir: nothing saved"
            guard.close()
            stop(engine, f"{guard.name}: stopped after step {done}; {where}; exit code {guard.exit_code} "
                         f"(restart with --resume)", guard.exit_code)

    if guard is not None:
        guard.close()
    link_bytes = read_link_bytes() - link_start if link_start is not None else None
    if hasattr(engine, "comm_stats"):  # ds_lowcomm: install the update still in flight (acco, demo overlap)
        engine.optimizer.flush()
    val_loss = evaluate(engine, val_tokens, args, rank, mbs, args.max_steps, host)
    record(val_loss=val_loss)
    sent, received, wait = meter.per_step()
    steps_run = args.max_steps - start
    # Tokens actually trained on, all ranks: under acco a rank may compute more or fewer
    # micro-batches per step than gradient_accumulation_steps.
    tokens_run = int(round(mean_over_ranks(micro_batches, host) * world)) * mbs * args.block_size
    result = {
        # ("automatic": the mode it chose, or resumed in)
        "mode": engine.optimizer.mode_name if hasattr(engine, "comm_stats") else mode, "world_size": world,
        "final_train_loss": mean_over_ranks(float(losses[-1]), host) if losses else float("nan"),
        "val_loss": val_loss, "steps": args.max_steps,
        "tokens": before["tokens"] + tokens_run,
        "tokens_per_s": tokens_run / train_time if train_time else float("nan"),
        "step_time_s": train_time / steps_run if steps_run else float("nan"),
        "bytes_sent_per_rank_per_step": sent, "bytes_received_per_rank_per_step": received,
        "exposed_comm_s_per_step": wait, "params": n_params, "skipped_steps": engine.skipped_steps,
        "micro_batches_per_round": meter.micro_batches_per_round(),
        # "mode": "automatic": what it chose and why
        **({"automatic": engine.optimizer.choice.as_dict()} if getattr(getattr(engine, "optimizer", None), "choice", None)
           else {}),
        # Loopback counts every rank's traffic once: per rank is the total over the world size.
        "link_bytes_per_rank_per_step": link_bytes / world / steps_run if link_bytes is not None and steps_run else None,
        "peak_rss_mb": max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, host),
    }
    if torch.device(engine.device).type == "cuda":
        for key, read in (("gpu_max_allocated_mb", torch.cuda.max_memory_allocated),
                          ("gpu_max_reserved_mb", torch.cuda.max_memory_reserved)):
            result[key] = max_over_ranks(read() / 2**20, host)
    say(f"final: train loss {result['final_train_loss']:.4f} | val loss {val_loss:.4f} | "
        f"{result['tokens_per_s']:,.0f} tok/s", flush=True)
    if records:
        records.close()
    say(json.dumps(result), flush=True)
    # Tear down in step: no rank may close its sockets while another is still in a collective.
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
