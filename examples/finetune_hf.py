"""Fine-tune a causal LM with the Hugging Face Trainer under a ds_lowcomm mode.

    torchrun --nproc_per_node 2 examples/finetune_hf.py --deepspeed ds_configs/hf/acco.json
    torchrun --nproc_per_node 2 examples/finetune_hf.py --deepspeed ds_configs/hf/zero1.json \\
        --model gpt2 --data my_instructions.jsonl

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
The last stdout line is one JSON object with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import transformers

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


class SlowRankTrainer(transformers.Trainer):
    """Emulates a slower accelerator: stretches this rank's compute (not its waiting for comm)."""

    def __init__(self, *args, slow: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow = slow

    def training_step(self, model, inputs, num_items_in_batch=None):
        stats = getattr(getattr(self.model_wrapped, "optimizer", None), "stats", None)
        waited = stats.wait_seconds if stats is not None else 0.0
        t0 = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.slow != 1.0:
            compute = time.perf_counter() - t0 - ((stats.wait_seconds - waited) if stats is not None else 0.0)
            time.sleep((self.slow - 1.0) * max(compute, 0.0))
        return loss


def parse_slow(text: str) -> dict:
    try:
        return {int(r): float(f) for r, f in (item.split(":") for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK:FACTOR[,RANK:FACTOR], e.g. 1:3")


def number(kind, lo):
    """argparse type: an int or float >= ``lo``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {'an integer' if kind is int else 'a number'}") from None
        if not value >= lo:
            raise argparse.ArgumentTypeError(f"got {value}; must be >= {lo}")
        return value
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deepspeed", required=True,
                    help="DeepSpeed JSON with a \"lowcomm\" section and \"auto\" values (ds_configs/hf/)")
    ap.add_argument("--model", default=None, help="NAME_OR_PATH of a causal LM; default: small GPT-2 from config")
    ap.add_argument("--data", default=None, help=".jsonl instructions/documents or a text file")
    ap.add_argument("--output-dir", default="runs/finetune_hf")
    ap.add_argument("--max-steps", type=number(int, 1), default=60, help="optimizer steps (warmup: a tenth, then cosine)")
    ap.add_argument("--micro-batch", type=number(int, 1), default=8, help="sequences per rank and micro-batch")
    ap.add_argument("--gas", type=number(int, 1), default=4, help="gradient accumulation steps")
    ap.add_argument("--block-size", type=number(int, 1), default=128)
    ap.add_argument("--lr", type=number(float, 0.0), default=1e-3)
    ap.add_argument("--save-steps", type=number(int, 0), default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    ap.add_argument("--slow-ranks", type=parse_slow, default={}, metavar="RANK:FACTOR[,...]")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


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
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=tok.vocab_size, n_positions=args.block_size, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id))
        encode, eos = tok, tok.pad_token_id
    dataset = Blocks(read_records(args.data), encode, eos, args.block_size)

    slow = args.slow_ranks.get(rank, 1.0)
    targs = transformers.TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.max_steps,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.gas,
        learning_rate=args.lr, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0,
        warmup_steps=max(1, args.max_steps // 10), lr_scheduler_type="cosine",
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(), disable_tqdm=True)
    trainer = SlowRankTrainer(model=model, args=targs, train_dataset=dataset, slow=slow)
    if slow != 1.0:
        print(f"rank {rank}: slowed down {slow:g}x (--slow-ranks)", flush=True)
    out = trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(f"{args.output_dir}/final")  # under ds_lowcomm: flushes the last update first
    engine = trainer.model_wrapped
    lowcomm = engine.comm_stats() if hasattr(engine, "comm_stats") else {}
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if rank == 0:
        print(json.dumps({"engine": type(engine).__name__, "config": args.deepspeed, "steps": out.global_step,
                          "train_seconds": out.metrics["train_runtime"], "train_loss": out.training_loss,
                          "final_logged_loss": losses[-1] if losses else None,
                          "bytes_sent_per_step": lowcomm.get("bytes_sent_per_step"),
                          "exposed_comm_s_per_step": lowcomm.get("wait_seconds_per_step"),
                          "slow_ranks": {str(k): v for k, v in args.slow_ranks.items()}}), flush=True)


if __name__ == "__main__":
    main()
