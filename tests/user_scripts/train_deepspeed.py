"""A plain DeepSpeed training script, as DeepSpeed's tutorials write one: DeepSpeed's own
command-line arguments (--deepspeed --deepspeed_config), deepspeed.initialize with training_data,
the engine's forward / backward / step, save_checkpoint / load_checkpoint. Run with `deepspeed`.

A user's script: it never names ds_lowcomm. The last lines write what the tests read (the engine
class, losses and step counts) to result_rank<N>.json in --save_dir.
"""
import argparse
import json
import os
import sys

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


class Blocks(torch.utils.data.Dataset):
    def __init__(self, path, tokenizer, block):
        with open(path, encoding="utf-8") as f:
            ids = tokenizer(f.read())["input_ids"]
        n = len(ids) // block
        self.data = torch.tensor(ids[: n * block]).view(n, block)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--tokenizer_name", required=True)
    parser.add_argument("--config_overrides", default=None)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--save_interval", type=int, default=0)
    parser.add_argument("--resume_tag", default=None, help="checkpoint tag to resume from, e.g. global_step20")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    config = AutoConfig.for_model("gpt2")
    if args.config_overrides:
        config.update_from_string(args.config_overrides)
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config)
    if os.environ.get("SLOW_RANKS"):  # the tests' emulated slower GPU (examples/common.py)
        import common
        common.slow_down_from_env(model)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=Blocks(args.train_file, tokenizer, args.block_size))
    if args.resume_tag:
        path, _ = engine.load_checkpoint(args.save_dir, tag=args.resume_tag)
        assert path is not None, f"no checkpoint in {args.save_dir}"
    losses = []
    while engine.global_steps < args.max_steps:
        for x in loader:
            x = x.to(engine.device)
            step = engine.global_steps
            loss = engine(x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if engine.global_steps != step and args.save_interval and engine.global_steps % args.save_interval == 0:
                engine.save_checkpoint(args.save_dir)
            if engine.global_steps >= args.max_steps:
                break
    with open(os.path.join(args.save_dir, f"result_rank{engine.global_rank}.json"), "w") as f:
        json.dump({"engine": type(engine).__name__, "engine_global_steps": engine.global_steps,
                   "losses": losses, "lowcomm_module": getattr(sys.modules.get("ds_lowcomm"), "__file__", None)}, f)


if __name__ == "__main__":
    main()
