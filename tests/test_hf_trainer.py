"""The Hugging Face Trainer on 2 ranks: every mode trains, zero1 equals the DeepSpeed loop, the
Trainer's own optimizer groups and LR schedule drive ours, resume is exact, metrics reach the logs."""
import copy
import signal

import pytest
import torch

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration

MBS, GAS, LR = 2, 2, 3e-3

AUTO_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}}
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                 "warmup_num_steps": 2, "total_num_steps": "auto"}}


def trainer_config(mode, optimizer=True, scheduler=True, **lowcomm):
    """A JSON as a Trainer user writes it: "auto" wherever the Trainer's arguments decide."""
    cfg = workers.config(mode, **lowcomm)
    cfg.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto",
               gradient_clipping="auto", train_batch_size="auto")
    del cfg["optimizer"]
    if optimizer:
        cfg["optimizer"] = copy.deepcopy(AUTO_OPTIMIZER)
    if scheduler:
        cfg["scheduler"] = copy.deepcopy(SCHEDULER)
    return cfg


class Batches(torch.utils.data.Dataset):
    """Deterministic byte-level samples; the same index gives the same sample on every rank."""

    def __init__(self, n=4096):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = workers.batch(i, 0, 0, mbs=1)[0]
        return {"input_ids": x, "labels": x.clone()}


def _trainer(rank, world, cfg, out_dir, steps, save_steps=None, resume=None, stop_after=None, slow_rank=None,
             samples=4096):
    import time

    import transformers

    import ds_lowcomm

    ds_lowcomm.skip_shm_comm_build()
    transformers.logging.set_verbosity_error()
    model = workers.tiny_gpt2(0)
    # Mean loss per micro-batch, as a plain DeepSpeed loop computes it (not the Trainer's
    # token-normalised variant), so the two runs can be compared number for number.
    model.accepts_loss_kwargs = False
    losses, batches, lrs, guarded = [], [], [], []
    sigterm = signal.getsignal(signal.SIGTERM)  # the handler before the Trainer's preemption guard
    model.register_forward_hook(lambda m, i, out: losses.append(out.loss.item()))
    if rank == slow_rank:
        model.register_forward_hook(lambda *_: time.sleep(0.05))

    def collate(samples):
        b = torch.utils.data.default_collate(samples)
        batches.append(b["input_ids"].clone())
        return b

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            lrs.append([g["lr"] for g in optimizer.optimizer.param_groups])

        def on_step_end(self, args, state, control, **kw):
            guarded.append(signal.getsignal(signal.SIGTERM) is not sigterm)
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True

    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=MBS, gradient_accumulation_steps=GAS,
        max_steps=steps, learning_rate=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-8, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], use_cpu=True, deepspeed=cfg, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Batches(samples), data_collator=collate,
                                   callbacks=[Probe()])
    trainer.train(resume_from_checkpoint=resume)
    sigterm_after_train = "the one before" if signal.getsignal(signal.SIGTERM) is sigterm else "another"
    engine = trainer.model_wrapped
    trainer.save_model(f"{out_dir}/final")
    return dict(engine=type(engine).__name__, optimizer=type(engine.optimizer).__name__,
                global_steps=engine.global_steps,
                losses=losses, batches=batches[:len(losses)],  # the loader prefetches one more
                lrs=lrs, log=trainer.state.log_history, guarded=guarded, sigterm_after_train=sigterm_after_train,
                weight_decays=[g["weight_decay"] for g in engine.optimizer.param_groups],
                master=engine.optimizer.master_weights(), digest=workers.params_digest(engine))


def _deepspeed_loop(rank, world, cfg, batches):
    """The same config and micro-batches through a plain DeepSpeed loop."""
    engine = workers.build_engine(cfg)
    losses = []
    for x in batches:
        loss = engine(x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# zero1 and demo (and acco again) run in user scripts under the Trainer in test_user_scripts.py;
# here, what those cannot see: desloc, acco's per-rank metrics and the flush at the final save.
# acco as ds_configs/hf/acco.json runs it (accumulate_while_waiting off): with it on, the
# micro-batches per round follow the ranks' timing, and so does the loss after 12 steps (one
# schedule in about five ended 0.295 below the first loss); that path under the Trainer is
# test_trainer_checkpoints_agree_when_acco_ranks_drift's.
@pytest.mark.parametrize("mode,lowcomm", [("acco", {"acco": {"accumulate_while_waiting": False}}),
                                          ("desloc", {"shard_group_size": 1, "desloc": {"param_sync_every": 2, "momentum_sync_every": 4, "variance_sync_every": 4}})])
def test_trainer_trains_every_mode(tmp_path, mode, lowcomm):
    steps = 12
    results = run_ranks(_trainer, 2, trainer_config(mode, **lowcomm), str(tmp_path), steps, timeout=600)
    r0 = results[0]
    assert r0["engine"] == "LowCommEngine" and r0["optimizer"] == "LowCommOptimizer"
    train_logs = [e for e in r0["log"] if "loss" in e]
    assert len(train_logs) == steps
    assert train_logs[-1]["loss"] < train_logs[0]["loss"] - 0.3
    # acco's first update completes during the Trainer's second step: from then on a norm is logged
    assert all(e["grad_norm"] > 0 for e in train_logs[2:])
    assert train_logs[-1]["lowcomm/bytes_sent_per_step"] > 0  # desloc sends nothing at step 1
    assert train_logs[-1]["lowcomm/skipped_steps"] == 0 and "lowcomm/loss_scale" not in train_logs[-1]
    # the preemption guard held SIGTERM from the first step's end, and train() gave it back
    assert r0["guarded"][1:] == [True] * (steps - 1) and r0["sigterm_after_train"] == "the one before"
    if mode == "acco":
        assert [k for k in train_logs[-1] if "micro_batches_per_round/rank" in k] == [
            "lowcomm/micro_batches_per_round/rank0", "lowcomm/micro_batches_per_round/rank1"]
    # the final save flushed: every rank's model holds the same (latest) weights
    assert results[0]["digest"] == results[1]["digest"]
    torch.testing.assert_close(results[0]["master"], results[1]["master"], rtol=0, atol=0)


def test_trainer_zero1_equals_deepspeed_loop(tmp_path):
    steps = 6
    cfg = trainer_config("zero1")
    trainer_runs = run_ranks(_trainer, 2, cfg, str(tmp_path), steps, timeout=600)
    # The JSON with the autos as the Trainer fills them from its arguments.
    plain = workers.config("zero1")
    plain["gradient_accumulation_steps"] = GAS
    plain["scheduler"] = copy.deepcopy(SCHEDULER)
    plain["scheduler"]["params"].update(warmup_max_lr=LR, total_num_steps=steps)
    plain["optimizer"]["params"]["lr"] = LR
    plain["optimizer"]["params"]["betas"] = [0.9, 0.95]
    loop_runs = run_ranks(_dispatch_loop, 2, plain, [r["batches"] for r in trainer_runs])
    for trainer_run, loop_losses in zip(trainer_runs, loop_runs):
        assert len(trainer_run["losses"]) == steps * GAS
        torch.testing.assert_close(trainer_run["losses"], loop_losses, rtol=1e-6, atol=0)


def _dispatch_loop(rank, world, cfg, batches_by_rank):
    return _deepspeed_loop(rank, world, cfg, batches_by_rank[rank])


def test_trainer_optimizer_groups_and_schedule_reach_ours(tmp_path):
    steps = 6
    cfg = trainer_config("zero1", optimizer=False, scheduler=False)
    r0 = run_ranks(_trainer, 2, cfg, str(tmp_path), steps, timeout=600)[0]
    # The Trainer's AdamW groups (biases and LayerNorms without decay) are ours, the same dicts.
    assert sorted(r0["weight_decays"]) == [0.0, 0.1]
    # linear warmup over 2 steps then linear decay to 0 at step 6, as the Trainer computes it
    expected = [LR * s / 2 if s < 2 else LR * (steps - s) / (steps - 2) for s in range(steps)]
    assert [lr[0] for lr in r0["lrs"]] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert all(len(set(lr)) == 1 for lr in r0["lrs"])


@pytest.mark.parametrize("mode,lowcomm", [("zero1", {}),
                                          ("acco", {"acco": {"accumulate_while_waiting": False}}),
                                          # every rank's weights are its own look-ahead point
                                          ("demo", {"shard_group_size": 1, "demo": {"overlap": True}})])
def test_trainer_resume_is_exact(tmp_path, mode, lowcomm):
    steps = 8
    # (lowcomm.pace decides which micro-batches a rank computes from its timing: a run that must
    # repeat another bit for bit computes all of them)
    cfg = trainer_config(mode, pace="slowest", **lowcomm)
    straight = run_ranks(_trainer, 2, cfg, str(tmp_path / "straight"), steps, timeout=600)
    run_ranks(_trainer, 2, cfg, str(tmp_path / "cut"), steps, 4, None, 4, timeout=600)
    resumed = run_ranks(_trainer, 2, cfg, str(tmp_path / "cut"), steps, None,
                        str(tmp_path / "cut" / "checkpoint-4"), timeout=600)
    final = [e["loss"] for e in straight[0]["log"] if "loss" in e]
    again = [e["loss"] for e in resumed[0]["log"] if "loss" in e]
    assert len(again) == steps and again == final  # the first 4 come from the checkpoint's history
    assert [r["digest"] for r in resumed] == [r["digest"] for r in straight]


def test_trainer_refuses_acco_computing_while_waiting(tmp_path):
    """accumulate_while_waiting would let a rank compute the Trainer's next step into this one, so
    the Trainer's step N would hold fewer updates: refused at the first backward pass, on every
    rank (no hang), with one line naming the key; its default follows the loop."""
    cfg = trainer_config("acco", acco={"accumulate_while_waiting": True})
    with pytest.raises(AssertionError) as err:
        run_ranks(_trainer, 2, cfg, str(tmp_path), 2, timeout=300)
    assert "LowCommConfigError: lowcomm.acco.accumulate_while_waiting: true cannot run under this loop" in str(err.value)
    assert "timed out" not in str(err.value)


def test_trainer_steps_agree_across_a_short_epoch_end(tmp_path):
    """20 samples, 2 ranks x 2 per micro-batch, accumulation 2: each epoch is 5 micro-batches per
    rank, so the Trainer's third step of every epoch has 1. acco takes that step there, so the
    Trainer's steps, DeepSpeed's and the checkpoint tags stay equal over the epochs."""
    steps = 6
    cfg = trainer_config("acco", acco={"accumulate_while_waiting": False})  # as ds_configs/hf/acco.json
    r0 = run_ranks(_trainer, 2, cfg, str(tmp_path), steps, 3, None, None, None, 20,
                   timeout=600)[0]
    assert [e["epoch"] for e in r0["log"] if "loss" in e][-1] == 2.0
    for step in (3, 6):
        tags = sorted(p.name for p in (tmp_path / f"checkpoint-{step}").glob("global_step*"))
        assert tags == [f"global_step{step}"], (step, tags)
    assert r0["global_steps"] == steps
