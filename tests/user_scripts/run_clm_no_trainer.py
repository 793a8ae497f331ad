"""A causal-LM training script written the way transformers' examples/pytorch/language-modeling/
run_clm_no_trainer.py is: accelerate's Accelerator, the `datasets` text loader, group_texts, a
torch AdamW with no decay on biases and LayerNorms, a transformers LR scheduler, save_state /
load_state checkpoints named step_<N>. Run with `accelerate launch --config_file`.

A user's script: it never names ds_lowcomm. The last lines write what the tests read (the engine
class, losses and step counts) to result_rank<N>.json in --output_dir.
"""
import argparse
import json
import math
import os
import sys
from itertools import chain

import datasets
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_scheduler


def parse_args():
    parser = argparse.ArgumentParser(description="Train a causal language model on a text file")
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--tokenizer_name", type=str, required=True)
    parser.add_argument("--model_type", type=str, default="gpt2")
    parser.add_argument("--config_overrides", type=str, default=None)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--max_train_steps", type=int, required=True)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--block_size", type=int, default=None)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    if args.seed is not None:
        set_seed(args.seed)

    raw_datasets = datasets.load_dataset("text", data_files={"train": args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    config = AutoConfig.for_model(args.model_type)
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    model.resize_token_embeddings(len(tokenizer))

    with accelerator.main_process_first():
        tokenized = raw_datasets.map(lambda ex: tokenizer(ex["text"]), batched=True, remove_columns=["text"])
    block_size = args.block_size or min(tokenizer.model_max_length, 1024)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = (len(concatenated[list(examples.keys())[0]]) // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with accelerator.main_process_first():
        lm_datasets = tokenized.map(group_texts, batched=True)
    train_dataloader = DataLoader(lm_datasets["train"], shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)

    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
                                 num_training_steps=args.max_train_steps * accelerator.num_processes)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    completed_steps, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        training_difference = os.path.splitext(os.path.basename(args.resume_from_checkpoint.rstrip("/")))[0]
        resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
        starting_epoch = resume_step // len(train_dataloader)
        completed_steps = resume_step // args.gradient_accumulation_steps
        resume_step -= starting_epoch * len(train_dataloader)

    losses = []
    for epoch in range(starting_epoch, num_train_epochs):
        model.train()
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                losses.append(loss.item())
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if args.checkpointing_steps and completed_steps % int(args.checkpointing_steps) == 0:
                    accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))
            if completed_steps >= args.max_train_steps:
                break
        if completed_steps >= args.max_train_steps:
            break

    accelerator.wait_for_everyone()
    with open(os.path.join(args.output_dir, f"result_rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"engine": type(model).__name__, "completed_steps": completed_steps,
                   "engine_global_steps": model.global_steps, "losses": losses,
                   "lowcomm_module": getattr(sys.modules.get("ds_lowcomm"), "__file__", None)}, f)


if __name__ == "__main__":
    main()
