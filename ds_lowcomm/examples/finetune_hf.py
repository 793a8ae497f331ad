"""Fine-tune a causal LM with the Hugging Face Trainer under a ds_lowcomm mode.

    torchrun --nproc_per_node 2 examples/finetune_hf.py --deepspeed ds_configs/hf/acco.json
    torchrun --nproc_per_node 2 examples/finetune_hf.py --deepspeed ds_configs/hf/zero1.json \\
        --model gpt2 --data my_instructions.jsonl
    torchrun --nproc_per_node 2 examples/finetune_hf.py    # no --deepspeed: the Trainer's plain DDP

A plain Trainer script: nothing here names ds_lowcomm. The installed autoload hook makes the
``"lowcomm"`` section of the JSON take effect; the Trainer fills the JSON's "auto" values from its
arguments (``ds_configs/hf/`` leave every batch, clipping and optimizer value to the script).
On a CPU-only machine prefix ``DS_ACCELERATOR=cpu``.

Data (``--data``): a ``.jsonl`` file of instructions (``{"instruction", "input"?, "output"}`` or
``{"prompt", "response"}``) or documents (``{"text"}``), or any text file. Without it, Python's own
documentation (``pydoc_data``, shipped with every Python). Model: a small GPT-2 built from its
config with byte-level tokens by default (no download); ``--model NAME_OR_PATH`` fine-tunes a real
checkpoint with its tokenizer. ``--slow-ranks 1:3`` makes rank 1 take 3x as long per micro-batch
(its compute, not its communication), to see how a mode copes with uneven hardware.

Validation: the last ``--val-fraction`` of the blocks is held out; every ``--eval-every`` steps
(and after training) every rank computes the loss of its own fixed ``--eval-iters`` micro-batches
of it, forward only in eval mode, averaged over the ranks. ``--log-json FILE``: rank 0 writes one
JSON record per logged step (``step``, ``train_s``, ``tokens``, ``loss``) and per validation
(``val_loss`` instead of ``loss``), ``train_s`` being the training clock without the validations
(the records ``examples/train.py --log-json`` writes, which ``python -m ds_lowcomm.bench`` reads;
after ``--resume`` the clock starts again at 0, where train.py's goes on).
The last stdout line is one JSON object with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import transformers

from common import at_least, dropout, fraction, host_group, max_over_ranks, mean_over_ranks, parse_slow_ranks, slow_down, slow_factor

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def read_records(path: str | None) -> list[str]:
    """Training texts: one per instruction/document, or chunks of a plain text file."""
    if path is None:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        return [topics[k] for k in sorted(topics)]
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"error: --data {path}: no such file")
    if p.suffix != ".jsonl":
        text = p.read_text(encoding="utf-8", errors="replace")
        return [text[i: i + 4096] for i in range(0, len(text), 4096)]
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        if "text" in r:
            out.append(r["text"])
        elif "instruction" in r or "prompt" in r:
            instruction = r.get("instruction", r.get("prompt"))
            if r.get("input"):
                instruction += "\n\n" + r["input"]
            out.append(PROMPT.format(instruction=instruction) + r.get("output", r.get("response", "")))
        else:
            raise SystemExit(f"error: --data {path} line {n}: expected a \"text\", \"instruction\"/\"output\" "
                             f"or \"prompt\"/\"response\" record, got keys {sorted(r)}")
    return out


class ByteTokenizer:
    """UTF-8 bytes; id 256 pads. For the built-from-config default model."""

    vocab_size = 257
    pad_token_id = 256

    def __call__(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class Blocks(torch.utils.data.Dataset):
    """Every text tokenised, concatenated and cut into blocks of ``block`` tokens."""

    def __init__(self, texts: list[str], encode, eos: int, block: int) -> None:
        ids = []
        for t in texts:
            ids += encode(t) + [eos]
        n = len(ids) // block
        if n == 0:
            raise SystemExit(f"error: the data has {len(ids)} tokens, fewer than one block of {block}")
        self.data = torch.tensor(ids[: n * block]).view(n, block)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


@torch.no_grad()
def evaluate(model, val: torch.Tensor, iters: int, mbs: int, rank: int, world: int, device, group) -> float:
    """Mean loss of fixed held-out micro-batches (each rank its own ``iters``), over the ranks.

    The plain model in eval mode under ``no_grad``: no gradient, no engine, nothing for a
    DeepSpeed or DDP wrapper to count; every rank runs the same number of forward passes."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)  # one host read, at the end
    for i in range(iters):
        rows = [((i * world + rank) * mbs + j) % len(val) for j in range(mbs)]
        x = val[rows].to(device)
        total += model(input_ids=x, labels=x).loss.detach()
    model.train(was_training)
    return mean_over_ranks(total.item() / iters, group)


class ValidationLog(transformers.TrainerCallback):
    """The training clock without validation time, a validation every ``every`` steps, progress
    lines and (rank 0) the ``--log-json`` records.

    Validation runs in ``on_step_end`` on every rank at the same steps (its loss is averaged over
    the ranks), and its time is subtracted from the clock."""

    def __init__(self, trainer, val: torch.Tensor, args, rank: int, world: int, group) -> None:
        self.trainer, self.val, self.rank, self.world, self.group = trainer, val, rank, world, group
        self.every, self.iters, self.mbs = args.eval_every, args.eval_iters, args.micro_batch
        self.tokens_per_step = args.micro_batch * args.gas * world * args.block_size
        self.records = open(args.log_json, "a") if (args.log_json and rank == 0) else None
        self.start, self.eval_s, self.train_s, self.first_step = time.perf_counter(), 0.0, 0.0, None

    def clock(self) -> float:
        return time.perf_counter() - self.start - self.eval_s

    def write(self, **record) -> None:
        if self.records:
            self.records.write(json.dumps(record) + "\n")
            self.records.flush()

    def validate(self, step: int) -> float:
        t0 = time.perf_counter()
        loss = evaluate(self.trainer.model, self.val, self.iters, self.mbs, self.rank, self.world,
                        self.trainer.args.device, self.group)
        self.eval_s += time.perf_counter() - t0
        self.write(step=step, train_s=self.train_s, val_loss=loss, tokens=step * self.tokens_per_step)
        if self.rank == 0:
            print(f"step {step}: val loss {loss:.4f}", flush=True)
        return loss

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step is None:  # the clock starts with the first step (after a resume's loading)
            self.start, self.eval_s, self.first_step = time.perf_counter(), 0.0, state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.train_s = self.clock()
        if self.every and state.global_step % self.every == 0 and state.global_step != state.max_steps:
            self.validate(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        step, seconds = state.global_step, self.train_s  # the clock at the end of that step
        self.write(step=step, train_s=seconds, loss=logs["loss"], tokens=step * self.tokens_per_step)
        if self.rank == 0:
            done = (step - self.first_step) * self.tokens_per_step
            print(f"step {step}/{state.max_steps} | loss {logs['loss']:.4f} | lr {logs.get('learning_rate', 0):.2e} | "
                  f"{done / max(seconds, 1e-9):,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.records:
            self.records.close()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepspeed", default=None,
                    help="DeepSpeed JSON with a \"lowcomm\" section and \"auto\" values (ds_configs/hf/); "
                         "without it, the Trainer's plain DDP")
    ap.add_argument("--model", default=None, help="NAME_OR_PATH of a causal LM; default: small GPT-2 from config")
    ap.add_argument("--data", default=None, help=".jsonl instructions/documents or a text file")
    ap.add_argument("--output-dir", default="runs/finetune_hf")
    ap.add_argument("--max-steps", type=at_least(int, 1), default=60, help="optimizer steps (warmup: a tenth, then cosine)")
    ap.add_argument("--micro-batch", type=at_least(int, 1), default=8, help="sequences per rank and micro-batch")
    ap.add_argument("--gas", type=at_least(int, 1), default=4, help="gradient accumulation steps")
    ap.add_argument("--block-size", type=at_least(int, 1), default=128)
    ap.add_argument("--n-layer", type=at_least(int, 1), default=4, help="default model: transformer blocks")
    ap.add_argument("--n-head", type=at_least(int, 1), default=4, help="default model: attention heads")
    ap.add_argument("--n-embd", type=at_least(int, 1), default=128, help="default model: width")
    ap.add_argument("--dropout", type=dropout, default=None, help="default model: dropout (default GPT-2's 0.1)")
    ap.add_argument("--lr", type=at_least(float, 0.0), default=1e-3)
    ap.add_argument("--save-steps", type=at_least(int, 0), default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--resume", nargs="?", const="latest", default=None, metavar="auto|DIR",
                    help="resume from the newest checkpoint in --output-dir (an error if there is none); "
                         "'--resume auto': from the newest if there is one, else start fresh; '--resume DIR': "
                         "from that checkpoint")
    ap.add_argument("--slow-ranks", type=parse_slow_ranks, default={}, metavar="RANK:FACTOR[,...]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-fraction", type=fraction, default=0.05, help="tail of the blocks held out")
    ap.add_argument("--eval-every", type=at_least(int, 0), default=0,
                    help="steps between validations (0: after training only)")
    ap.add_argument("--eval-iters", type=at_least(int, 1), default=10, help="micro-batches per rank per validation")
    ap.add_argument("--log-every", type=at_least(int, 1), default=None, help="steps between logs (default: a tenth)")
    ap.add_argument("--log-json", default=None, metavar="FILE",
                    help="rank 0 appends one JSON record per logged step and validation")
    args = ap.parse_args(argv)
    if not args.model and args.n_embd % args.n_head:
        ap.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.dropout is not None and args.model:
        ap.error(f"--dropout applies to the default model; --model {args.model} keeps its own (set it in its "
                 f"config), or leave --dropout out")
    return args


def resume_point(resume, output_dir: str):
    """What ``--resume`` gives the Trainer's ``resume_from_checkpoint``: None (start fresh), or the
    checkpoint directory to load. Bare ``--resume`` ("latest") and ``--resume auto`` take the newest
    ``checkpoint-N`` in ``output_dir``; without one the first exits with one line, the second starts
    fresh. Anything else is a checkpoint directory."""
    if resume not in ("latest", "auto"):
        return resume
    newest = transformers.trainer_utils.get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if newest is None and resume == "latest":
        raise SystemExit(f"error: --resume: no checkpoint-N in {output_dir}; use --resume auto to start fresh "
                         f"when there is none")
    if newest is None and int(os.environ.get("RANK", 0)) == 0:
        print(f"--resume auto: no checkpoint in {output_dir} yet; starting fresh", flush=True)
    return newest


def default_model(args: argparse.Namespace, tok: ByteTokenizer) -> transformers.GPT2LMHeadModel:
    """The model trained without ``--model``: a fresh GPT-2 of ``--n-layer`` × ``--n-embd`` over
    ``tok``'s bytes; ``--dropout``, where given, for its residual, embedding and attention dropout."""
    drop = {} if args.dropout is None else dict(resid_pdrop=args.dropout, embd_pdrop=args.dropout,
                                                attn_pdrop=args.dropout)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tok.vocab_size, n_positions=args.block_size, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_head, **drop, bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id))


def main() -> None:
    args = parse_args()

    rank = int(os.environ.get("RANK", 0))
    transformers.set_seed(args.seed)
    if args.model:
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model)
        encode, eos = (lambda t: tok(t)["input_ids"]), tok.eos_token_id
    else:
        tok = ByteTokenizer()
        model = default_model(args, tok)
        encode, eos = tok, tok.pad_token_id
    dataset = Blocks(read_records(args.data), encode, eos, args.block_size)
    n_val = int(len(dataset) * args.val_fraction)
    if n_val < 1 or n_val >= len(dataset):
        raise SystemExit(f"error: {len(dataset)} blocks of {args.block_size} tokens: --val-fraction "
                         f"{args.val_fraction:g} leaves {n_val} for validation and {len(dataset) - n_val} "
                         f"for training; both need at least one (give more --data or change --val-fraction)")
    val = dataset.data[len(dataset) - n_val:]
    dataset.data = dataset.data[: len(dataset) - n_val]

    slow = slow_factor(args.slow_ranks, rank, int(os.environ.get("WORLD_SIZE", 1)))
    slow_down(model, slow)
    targs = transformers.TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.max_steps,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.gas,
        learning_rate=args.lr, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0,
        warmup_steps=max(1, args.max_steps // 10), lr_scheduler_type="cosine",
        logging_steps=args.log_every or max(1, args.max_steps // 10),
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(), disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset)
    world = targs.world_size
    host = host_group()  # after TrainingArguments set up the process group
    log = ValidationLog(trainer, val, args, rank, world, host)
    trainer.add_callback(log)
    if slow != 1.0:
        print(f"rank {rank}: slowed down {slow:g}x (--slow-ranks)", flush=True)
    out = trainer.train(resume_from_checkpoint=resume_point(args.resume, args.output_dir))
    trainer.save_model(f"{args.output_dir}/final")  # under ds_lowcomm: flushes the last update first
    val_loss = log.validate(out.global_step)  # after the flush: the weights with every update
    log.close()
    engine = trainer.model_wrapped
    lowcomm = engine.comm_stats() if hasattr(engine, "comm_stats") else {}
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    steps_run = out.global_step - (log.first_step or 0)  # by this process (after a resume: since it)
    tokens = out.global_step * log.tokens_per_step
    peak_rss_mb = max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, host)
    if rank == 0:
        print(json.dumps({"engine": type(engine).__name__, "config": args.deepspeed, "steps": out.global_step,
                          "train_seconds": out.metrics["train_runtime"], "train_loss": out.training_loss,
                          "final_logged_loss": losses[-1] if losses else None,
                          "bytes_sent_per_step": lowcomm.get("bytes_sent_per_step"),
                          "slow_ranks": {str(k): v for k, v in args.slow_ranks.items()},
                          # the schema of examples/train.py's result line (ds_lowcomm.bench reads it);
                          # the clock excludes validation; tokens: those the loop handed out
                          "world_size": world, "val_loss": val_loss,
                          "final_train_loss": losses[-1] if losses else float("nan"),
                          "tokens": tokens, "train_s": log.train_s,
                          "tokens_per_s": steps_run * log.tokens_per_step / log.train_s if log.train_s else float("nan"),
                          "step_time_s": log.train_s / steps_run if steps_run else float("nan"),
                          "bytes_sent_per_rank_per_step": lowcomm.get("bytes_sent_per_step"),
                          "bytes_received_per_rank_per_step": lowcomm.get("bytes_received_per_step"),
                          "exposed_comm_s_per_step": lowcomm.get("exposed_comm_s_per_step"),
                          "micro_batches_per_round": lowcomm.get("micro_batches_per_round"),
                          "computed_share_by_rank": lowcomm.get("computed_share_by_rank"),
                          "link_bytes_per_rank_per_step": None, "peak_rss_mb": peak_rss_mb,
                          "params": sum(p.numel() for p in model.parameters())}), flush=True)


if __name__ == "__main__":
    main()
