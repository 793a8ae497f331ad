"""A causal-LM training script written the way transformers' examples/pytorch/language-modeling/
run_clm.py is: HfArgumentParser, the `datasets` text loader, group_texts, the Trainer, --deepspeed.

A user's script: it never names ds_lowcomm. The last lines write what the tests read (the engine
class and the Trainer's log history) to result_rank<N>.json in --output_dir.
"""
import json
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

import datasets
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, Trainer,
                          TrainingArguments, default_data_collator, set_seed)


@dataclass
class ModelArguments:
    model_type: str = field(default="gpt2", metadata={"help": "model type to build from scratch"})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "e.g. n_embd=32,n_layer=1"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "tokenizer name or path"})


@dataclass
class DataTrainingArguments:
    train_file: Optional[str] = field(default=None, metadata={"help": "a text file"})
    block_size: Optional[int] = field(default=None)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)

    raw_datasets = datasets.load_dataset("text", data_files={"train": data_args.train_file})
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    config = AutoConfig.for_model(model_args.model_type)
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)
    model.resize_token_embeddings(len(tokenizer))
    if os.environ.get("SLOW_RANKS"):  # the tests' emulated slower GPU (examples/common.py)
        import common
        common.slow_down_from_env(model)

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw_datasets.map(tokenize_function, batched=True, remove_columns=["text"])
    block_size = data_args.block_size or min(tokenizer.model_max_length, 1024)

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {k: [t[i: i + block_size] for i in range(0, total_length, block_size)]
                  for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        lm_datasets = tokenized.map(group_texts, batched=True)

    trainer = Trainer(model=model, args=training_args, train_dataset=lm_datasets["train"],
                      processing_class=tokenizer, data_collator=default_data_collator)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_state()

    engine = trainer.model_wrapped
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(training_args.output_dir, f"result_rank{rank}.json"), "w") as f:
        json.dump({"engine": type(engine).__name__, "global_step": trainer.state.global_step,
                   "engine_global_steps": engine.global_steps, "log": trainer.state.log_history,
                   "lowcomm_module": getattr(sys.modules.get("ds_lowcomm"), "__file__", None)}, f)


if __name__ == "__main__":
    main()
