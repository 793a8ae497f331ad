"""Checkpoints: fp32 export, loads at another world size, clear errors for damaged or unsafe
files (exact resume in every mode: test_resume.py)."""
import copy
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import workers
from dist import run_ranks

pytestmark = pytest.mark.integration

N = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_and_save(rank, world, save_dir):
    engine = workers.build_engine(workers.config("zero1"))
    workers.train(engine, N, rank=rank)
    engine.save_checkpoint(save_dir, client_state={"step": N})
    return dict(master=engine.optimizer.master_weights(), names=engine.optimizer.param_names)


def test_export_and_load_at_one_rank(tmp_path):
    r0, _ = run_ranks(_train_and_save, 2, str(tmp_path))

    # The export CLI, spelt as documented, writes the fp32 master weights under every state_dict
    # name (this checkout's code: the console script imports the package from PYTHONPATH first).
    out = tmp_path / "fp32.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "ds-lowcomm-export"), str(tmp_path), str(out)],
                   check=True, capture_output=True, env=env)
    exported = torch.load(out)
    offset = 0
    for names in r0["names"]:
        value = exported[names[0]]
        n = value.numel()
        assert value.dtype == torch.float32
        assert torch.equal(value.flatten(), r0["master"][offset: offset + n])
        for alias in names[1:]:  # tied weights (GPT-2's lm_head.weight is wte.weight)
            assert torch.equal(exported[alias], value)
        offset += n
    assert offset == r0["master"].numel()
    model = workers.tiny_gpt2()
    model.load_state_dict(exported)  # strict: every key of the model is there
    # The same as safetensors, which Hugging Face loads.
    from safetensors.torch import load_file

    st = tmp_path / "model.safetensors"
    subprocess.run([sys.executable, "-m", "ds_lowcomm.checkpoint", "export", str(tmp_path), str(st)],
                   check=True, capture_output=True)
    loaded = load_file(st)
    assert loaded.keys() == exported.keys() and all(torch.equal(loaded[k], exported[k]) for k in loaded)

    # Stock DeepSpeed's way: the zero_to_fp32.py in the checkpoint directory, run from inside it,
    # writes safetensors and the model's config.json, which from_pretrained reads.
    subprocess.run([sys.executable, "zero_to_fp32.py", ".", "hf", "--safe_serialization"], cwd=tmp_path,
                   check=True, capture_output=True, env=env)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = hf.state_dict()
    assert state.keys() == exported.keys() and all(torch.equal(state[k], exported[k]) for k in state)
    assert "--safe_serialization" in subprocess.run(
        [sys.executable, "zero_to_fp32.py", "--help"], cwd=tmp_path, check=True, capture_output=True, text=True,
        env=env).stdout

    # The 2-rank checkpoint loads on 1 rank: same master, and training goes on from it.
    (one,) = run_ranks(_load_and_train_alone, 1, str(tmp_path))
    assert torch.equal(one["master"], r0["master"])
    wo = one["weights_only"]
    assert torch.equal(wo["master"], r0["master"])
    # Training goes on from the loaded weights (a restart from this run's init would be ~5.5).
    assert all(math.isfinite(l) for l in wo["losses"]) and abs(wo["losses"][0] - one["losses"][0]) < 0.05
    assert one["losses"][-1] < one["losses"][0] + 0.05 and all(math.isfinite(l) for l in one["losses"])


def _load_and_train_alone(rank, world, save_dir):
    engine = workers.build_engine(workers.config("zero1"), seed=7)
    _, client = engine.load_checkpoint(save_dir)
    master = engine.optimizer.master_weights()
    losses = workers.train(engine, 3, start=client["step"], rank=rank)
    # The weights only, into another mode (what the error messages tell a user to do): the fp32
    # master comes from the checkpoint, not from this run's start, and survives the next step.
    acco = workers.build_engine(workers.config("acco"), seed=7)
    acco.load_checkpoint(save_dir, load_optimizer_states=False)
    weights_only = dict(master=acco.optimizer.master_weights(),
                        losses=workers.train(acco, 2, start=client["step"], rank=rank))
    return dict(master=master, losses=losses, weights_only=weights_only)


def _load_errors(rank, world, save_dir, empty_dir):
    from unittest import mock

    from ds_lowcomm import CheckpointError

    errors = {}
    other = workers.build_engine(workers.config("zero1"), model=workers.tiny_gpt2(n_embd=48))
    for name, path in (("other_model", save_dir), ("missing", empty_dir)):
        try:
            other.load_checkpoint(path)
        except CheckpointError as err:
            errors[name] = str(err)

    # A save that dies after DeepSpeed wrote its file but before our manifest: `latest` still
    # names the previous, complete checkpoint, which loads.
    engine = workers.build_engine(workers.config("zero1"))
    workers.train(engine, 1, rank=rank)
    with mock.patch("ds_lowcomm.checkpoint.checkpointer.write_manifest", side_effect=KeyboardInterrupt("killed")):
        try:
            engine.save_checkpoint(save_dir, tag="torn")
        except KeyboardInterrupt:
            pass
    with open(os.path.join(save_dir, "latest")) as f:
        errors["latest_after_torn_save"] = f.read()
    engine.load_checkpoint(save_dir)

    # A second save of the tag `latest` names, killed between swapping the old content out and
    # the new in: the old content loads, exactly; the next save of the tag cleans up.
    engine.save_checkpoint(save_dir, tag="again")
    before = engine.optimizer.master_weights()
    workers.train(engine, 1, start=1, rank=rank)
    rename = os.rename

    def killed_at_second_rename(src, dst):
        if str(src).endswith(".saving"):
            raise KeyboardInterrupt("killed")
        rename(src, dst)

    with mock.patch("ds_lowcomm.checkpoint.checkpointer.os.rename", side_effect=killed_at_second_rename):
        try:
            engine.save_checkpoint(save_dir, tag="again")
        except KeyboardInterrupt:
            pass
    errors["resave_left"] = sorted(n for n in os.listdir(save_dir) if n.startswith("again"))
    fresh = workers.build_engine(workers.config("zero1"), seed=3)
    fresh.load_checkpoint(save_dir)
    errors["resave_loads_previous"] = torch.equal(fresh.optimizer.master_weights(), before)
    # The resumed run saves that tag again and is killed while writing its file: staged beside it
    # again, the previous content under ".replaced" untouched, and still what loads.
    workers.train(fresh, 1, start=2, rank=rank)
    with mock.patch("ds_lowcomm.checkpoint.checkpointer.atomic_save", side_effect=KeyboardInterrupt("killed")):
        try:
            fresh.save_checkpoint(save_dir, tag="again")
        except KeyboardInterrupt:
            pass
    errors["second_kill_left"] = sorted(n for n in os.listdir(save_dir) if n.startswith("again"))
    other = workers.build_engine(workers.config("zero1"), seed=4)
    other.load_checkpoint(save_dir)
    errors["second_kill_loads_previous"] = torch.equal(other.optimizer.master_weights(), before)
    fresh.save_checkpoint(save_dir, tag="again")  # a save that completes replaces it and cleans up
    errors["resave_after"] = sorted(n for n in os.listdir(save_dir) if n.startswith("again"))

    # A checkpoint in the format before sharded saves (the full state in the model file, no rank
    # file, no manifest for zero1), rewritten from this one by hand: it still loads, exactly.
    tag_dir = os.path.join(save_dir, "global_step1")
    shards = torch.load(os.path.join(tag_dir, "lowcomm_rank00000.pt"), weights_only=True)["shards"]
    model = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=True)
    numel = model["optimizer"]["shards"]["numel"]
    legacy = {k: v for k, v in model["optimizer"].items() if k != "shards"}
    legacy.update(format="ds_lowcomm/1", **{k: shards[k][:numel].clone() for k in shards})
    legacy_dir = os.path.join(os.path.dirname(save_dir), "legacy")
    os.makedirs(os.path.join(legacy_dir, "global_step1"))
    torch.save({**model, "optimizer": legacy}, os.path.join(legacy_dir, "global_step1", "mp_rank_00_model_states.pt"))
    with open(os.path.join(legacy_dir, "latest"), "w") as f:
        f.write("global_step1")
    fresh = workers.build_engine(workers.config("zero1"), seed=3)
    fresh.load_checkpoint(legacy_dir)
    a = fresh.optimizer.mode.adamw
    errors["legacy_equal"] = all(torch.equal(getattr(a, k)[:numel], shards[k][:numel])
                                 for k in ("master", "exp_avg", "exp_avg_sq")) and a.step_count == 1
    return errors


def test_checkpoint_errors(tmp_path):
    save_dir = tmp_path / "ckpt"
    run_ranks(_save_small, 1, str(save_dir))
    (errors,) = run_ranks(_load_errors, 1, str(save_dir), str(tmp_path / "empty"))
    assert "different model" in errors["other_model"]
    assert "[256, 32]" in errors["other_model"] and "[256, 48]" in errors["other_model"]
    assert "no checkpoint" in errors["missing"]
    assert errors["latest_after_torn_save"] == "global_step1"
    assert errors["resave_left"] == ["again.replaced", "again.saving"]
    assert errors["resave_loads_previous"]
    assert "again.replaced" in errors["second_kill_left"], errors["second_kill_left"]
    assert errors["second_kill_loads_previous"]
    assert errors["resave_after"] == ["again"]
    assert errors["legacy_equal"]


class _Planted:
    """What an attacker puts in a checkpoint: unpickling it creates a file (any code could run)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tamper(case, tag_dir, marker):
    from ds_lowcomm.checkpoint import MANIFEST, MODEL_FILE

    model, rank1 = os.path.join(tag_dir, MODEL_FILE), os.path.join(tag_dir, "lowcomm_rank00001.pt")
    if case == "flipped":  # 16 bytes in the middle of the model file, size unchanged
        with open(model, "r+b") as f:
            f.seek(os.path.getsize(model) // 2)
            data = f.read(16)
            f.seek(-16, 1)
            f.write(bytes(b ^ 0xFF for b in data))
    elif case in ("truncated", "truncated_unrecorded"):
        victim = rank1 if case == "truncated" else model
        os.truncate(victim, os.path.getsize(victim) // 2)
    elif case.startswith("planted"):
        torch.save({"module": {}, "optimizer": _Planted(marker)}, model)
    elif case == "missing":
        os.remove(rank1)
    if case in ("truncated_unrecorded", "planted_unrecorded", "unrecorded"):
        os.remove(os.path.join(tag_dir, MANIFEST))


TAMPER_CASES = ("flipped", "truncated", "truncated_unrecorded", "planted", "planted_unrecorded", "missing",
                "unrecorded")


def _load_tampered(rank, world, root):
    """One saved checkpoint (demo: per-rank files too), then each case on a copy of it."""
    from ds_lowcomm import CheckpointError

    engine = workers.build_engine(workers.config("demo", shard_group_size=1))
    workers.train(engine, 2, rank=rank)
    good = os.path.join(root, "good")
    engine.save_checkpoint(good)
    tag = open(os.path.join(good, "latest")).read()
    out = {}
    for case in TAMPER_CASES:
        case_dir, marker = os.path.join(root, case), os.path.join(root, case + ".marker")
        if rank == 0:
            shutil.copytree(good, case_dir)
            _tamper(case, os.path.join(case_dir, tag), marker)
        torch.distributed.barrier()
        try:
            engine.load_checkpoint(case_dir)
            out[case] = "loaded"
        except CheckpointError as err:
            out[case] = str(err)
        out[case + ".marker"] = os.path.exists(marker)
    return out


def test_damaged_or_unsafe_files_are_refused(tmp_path):
    """Each bad file gets a one-line CheckpointError naming it, on every rank, before anything is
    loaded; a planted pickle never runs, with or without a manifest to catch it."""
    r0, r1 = run_ranks(_load_tampered, 2, str(tmp_path))
    for rank, r in enumerate((r0, r1)):
        want = {
            "flipped": ("mp_rank_00_model_states.pt", "sha256"),
            "truncated": ("lowcomm_rank00001.pt", "truncated"),
            "truncated_unrecorded": ("mp_rank_00_model_states.pt", "cannot be read"),
            "planted": ("mp_rank_00_model_states.pt", "the manifest recorded"),
            "planted_unrecorded": ("mp_rank_00_model_states.pt", "arbitrary unpickling"),
            "missing": ("lowcomm_rank00001.pt", "does not exist"),
        }
        for case, words in want.items():
            msg = r[case]
            assert "\n" not in msg and all(w in msg for w in words), f"rank {rank}, {case}: {msg}"
            if rank == 0 and "rank00001" in words[0]:
                assert msg.startswith("rank 1: "), msg  # rank 0's own files were fine
        assert r["unrecorded"] == "loaded"  # an older checkpoint without a manifest still loads
        assert not any(r[c + ".marker"] for c in TAMPER_CASES)


def _save_small(rank, world, save_dir):
    engine = workers.build_engine(workers.config("zero1"))
    workers.train(engine, 1, rank=rank)
    engine.save_checkpoint(save_dir)


def _save_sharded(rank, world, save_dir):
    engine = workers.build_engine(workers.config("zero1"))
    workers.train(engine, 2, rank=rank)
    sent_before = engine.comm_stats()["bytes_sent"] + engine.optimizer.checkpoint_stats.bytes_sent
    engine.save_checkpoint(save_dir)
    sent_after = engine.comm_stats()["bytes_sent"] + engine.optimizer.checkpoint_stats.bytes_sent
    return {"state_bytes_sent_at_save": sent_after - sent_before, "numel": engine.optimizer.flat.layout.numel}


def _load_sharded(rank, world, save_dir):
    engine = workers.build_engine(workers.config("zero1"), seed=5)
    engine.load_checkpoint(save_dir)
    a, layout = engine.optimizer.mode.adamw, engine.optimizer.flat.layout
    out = {k: getattr(a, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}
    out.update(start=layout.shard_start, step=a.step_count,
               losses=workers.train(engine, 2, start=2, rank=rank))
    return out


@pytest.mark.parametrize("world", [4, 1])
def test_sharded_save_loads_at_another_world_size(tmp_path, world):
    """Each rank saves only its shard, nothing of the optimizer state crosses the network; a run
    of another size cuts its own shards out of those files, equal to what was saved."""
    saved = run_ranks(_save_sharded, 2, str(tmp_path))
    assert all(r["state_bytes_sent_at_save"] == 0 for r in saved)
    numel = saved[0]["numel"]
    tag_dir = tmp_path / "global_step2"
    files = [torch.load(tag_dir / f"lowcomm_rank{r:05d}.pt", weights_only=True) for r in range(2)]
    assert not (tmp_path / "global_step2" / "lowcomm_rank00002.pt").exists()
    loaded = run_ranks(_load_sharded, world, str(tmp_path))
    for key in ("master", "exp_avg", "exp_avg_sq"):
        full = torch.cat([f["shards"][key] for f in files])  # the saved shards, in rank order
        assert full[numel:].abs().sum() == 0  # padding
        for r in loaded:
            shard = r[key]
            real = max(0, min(shard.numel(), numel - r["start"]))
            assert torch.equal(shard[:real], full[r["start"]: r["start"] + real]), key
            assert shard[real:].abs().sum() == 0
    for r in loaded:
        assert r["step"] == 2 and all(math.isfinite(l) for l in r["losses"])


# Per-replica state saved at 2 ranks (2 replicas, or acco's mid-step accumulators), loaded at
# another world size: (config, micro-batches before the save).
PER_RANK = {
    "acco": (workers.config("acco", acco={"accumulate_while_waiting": False}), 5),  # mid-step
    "demo": (workers.config("demo", shard_group_size=1), 4),
    "desloc": (workers.config("desloc", shard_group_size=1, desloc={"param_sync_every": 4}), 6),  # mid-period
    # after a compressed sync at step 2: each replica's error buffer holds what it did not send
    "desloc-compressed": (workers.config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 2, "momentum_sync_every": 0, "variance_sync_every": 0, "sync_topk": 1}), 6),
    # after compressed moment syncs (m at 2, v at 3): the replicas' moments differ, the anchors agree
    "desloc-compressed-moments": (workers.config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 5, "momentum_sync_every": 2, "variance_sync_every": 3, "moment_sync_topk": 2}), 8),
    # a streamed sync launched at step 3 with the first moment, saved in flight (it would be
    # applied at step 5); loaded at another layout, the moments' replica mean is what applying it gives
    "desloc-streamed": (workers.config("desloc", shard_group_size=1, desloc={
        "param_sync_every": 3, "momentum_sync_every": 3, "param_sync_delay": 2}), 8),
}


def _save_per_rank(rank, world, save_dir, mode):
    cfg, micro_batches = PER_RANK[mode]
    engine = workers.build_engine(cfg)
    workers.micro_batches(engine, 0, micro_batches, rank)
    engine.save_checkpoint(save_dir)
    return engine.optimizer.flat.layout.numel


def _load_per_rank(rank, world, save_dir, mode):
    engine = workers.build_engine(PER_RANK[mode][0], seed=5)
    engine.load_checkpoint(save_dir)
    opt, out = engine.optimizer, {}
    numel = opt.flat.layout.numel
    if mode == "acco":
        out.update(accumulator=opt.grads.buffer[:numel].clone(), micro_batches=opt.grads.micro_batches)
    elif mode == "demo":
        out.update(momentum=opt.mode.shard.momentum.clone())
    else:
        a = opt.mode.adamw
        out.update({k: getattr(a, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}, step=a.step_count,
                   params=opt.flat.unpadded(opt.flat.buffer).float().clone(),
                   anchors={k: m.anchor.clone() for k, m in opt.mode.syncs.moment_syncs.items()})
    out.update(start=opt.flat.layout.shard_start,
               losses=workers.train(engine, 2, start=4, rank=rank), digest=workers.params_digest(engine))
    return out


def _applied_sync(master, saved, numel):
    """A streamed sync saved in flight, applied at the load to the replicas' mean ``master``: plus
    its result (the same on both), minus the mean of each replica's master at the launch (the
    local progress first: where nothing moved since the launch, exactly the result)."""
    (ra, rb), (la, lb) = ([s["shards"][k][:numel] for s in saved] for k in ("sync_result", "sync_launched"))
    assert torch.equal(ra, rb) and not torch.equal(la, lb)
    return master - (la + lb) / 2 + (ra + rb) / 2


@pytest.mark.parametrize("mode", list(PER_RANK))
def test_per_rank_state_reshards(tmp_path, mode):
    """A checkpoint whose ranks hold different state loads at 4 ranks and at 1: DES-LOC's
    replicas and DeMo's δ averaged, ACCO's mid-step gradient sums gathered on rank 0 with their
    count; checked against the saved files themselves."""
    numel = run_ranks(_save_per_rank, 2, str(tmp_path), mode)[0]
    tag = next(p for p in tmp_path.iterdir() if p.name.startswith("global_step"))
    saved = [torch.load(tag / f"lowcomm_rank{r:05d}.pt", weights_only=True) for r in range(2)]
    if mode == "desloc-compressed-moments":
        for key in ("exp_avg", "exp_avg_sq"):  # the replicas agreed on the anchors, not on the moments
            a, b = (s["shards"][f"anchor_{key}"][:numel] for s in saved)
            assert torch.equal(a, b) and a.abs().sum() > 0, key
    for world in (4, 1):
        loaded = run_ranks(_load_per_rank, world, str(tmp_path), mode)
        for r, got in enumerate(loaded):
            assert all(math.isfinite(l) for l in got["losses"])
            if mode == "acco":
                if r == 0:
                    want = sum(s["mode"]["accumulator"][:numel] for s in saved)
                    assert torch.equal(got["accumulator"], want)
                    assert got["micro_batches"] == sum(s["mode"]["micro_batches"] for s in saved) > 0
                else:
                    assert got["accumulator"].abs().sum() == 0 and got["micro_batches"] == 0
                continue
            keys = ("momentum",) if mode == "demo" else ("master", "exp_avg", "exp_avg_sq")
            for key in keys:  # shard_group_size 1: each saved file holds its replica's whole vector
                a, b = (s["shards"][key][:numel] for s in saved)
                assert not torch.equal(a, b), key  # the replicas really differed
                mean = (a + b) / 2
                if mode == "desloc-compressed" and key == "master":
                    # what the replicas' syncs had not sent yet, folded into the master: not lost
                    ea, eb = (s["shards"]["sync_error"][:numel] for s in saved)
                    assert ea.abs().sum() > 0 and eb.abs().sum() > 0
                    mean = mean - (ea + eb) / 2
                if mode == "desloc-streamed" and key == "master":
                    mean = _applied_sync(mean, saved, numel)
                shard = got[key]
                real = max(0, min(shard.numel(), numel - got["start"]))
                assert torch.equal(shard[:real], mean[got["start"]: got["start"] + real]), key
                if key in got.get("anchors", {}):  # anchored where a dense sync would have agreed
                    assert torch.equal(got["anchors"][key], shard), key
            if mode.startswith("desloc"):
                assert got["step"] == saved[0]["mode"]["step"]
                want = (saved[0]["shards"]["master"][:numel] + saved[1]["shards"]["master"][:numel]) / 2
                if mode == "desloc-compressed":
                    want = want - (saved[0]["shards"]["sync_error"][:numel]
                                   + saved[1]["shards"]["sync_error"][:numel]) / 2
                if mode == "desloc-streamed":
                    want = _applied_sync(want, saved, numel)
                assert torch.equal(got["params"], want)
        if not mode.startswith("desloc"):  # DES-LOC replicas drift again after the load, by design
            assert len({got["digest"] for got in loaded}) == 1


def _load_weights_only(rank, world, save_dir):
    engine = workers.build_engine(PER_RANK["desloc-streamed"][0], seed=5)
    engine.load_checkpoint(save_dir, load_optimizer_states=False)
    opt = engine.optimizer
    return opt.flat.unpadded(opt.flat.buffer).float().clone(), opt.mode.syncs.ticket is None


def _load_without_streaming(rank, world, save_dir):
    cfg = copy.deepcopy(PER_RANK["desloc-streamed"][0])
    cfg["lowcomm"]["desloc"]["param_sync_delay"] = 0
    engine = workers.build_engine(cfg, seed=5)
    engine.load_checkpoint(save_dir)
    a = engine.optimizer.mode.adamw
    return {k: getattr(a, k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}


def test_a_run_without_streaming_applies_the_saved_sync_at_the_load(tmp_path):
    """The same layout resumed with param_sync_delay 0: each replica applies the sync saved in
    flight at the load, read here from its own file: master + result − master at the launch, the
    first moment launched with it m + β1^n·(m̄ − m at the launch), n = the Adam steps since the
    launch (1 here), β1 = 0.9 (the config's); the second moment was not in flight."""
    numel = run_ranks(_save_per_rank, 2, str(tmp_path), "desloc-streamed")[0]
    tag = next(p for p in tmp_path.iterdir() if p.name.startswith("global_step"))
    saved = [torch.load(tag / f"lowcomm_rank{r:05d}.pt", weights_only=True) for r in range(2)]
    for r, got in enumerate(run_ranks(_load_without_streaming, 2, str(tmp_path))):
        shards, n = saved[r]["shards"], saved[r]["mode"]["step"] - saved[r]["mode"]["sync_launch_step"]
        assert n == 1 and "sync_launched_exp_avg_sq" not in shards
        want = {"master": shards["master"] + shards["sync_result"] - shards["sync_launched"],
                "exp_avg": shards["exp_avg"] + 0.9 ** n * (shards["sync_result_exp_avg"]
                                                           - shards["sync_launched_exp_avg"]),
                "exp_avg_sq": shards["exp_avg_sq"]}
        for key, value in want.items():
            torch.testing.assert_close(got[key][:numel], value[:numel], rtol=1e-6, atol=1e-9)
        assert not torch.equal(got["exp_avg"], shards["exp_avg"])


def _load_with_compressed_moments(rank, world, save_dir, weights_only):
    """PER_RANK's desloc checkpoint (dense moment syncs, no anchors) loaded with compressed moment
    syncs (m at 2, v at 3); weights only, after 3 steps of training (syncs at 2 and 3: anchors
    away from zero)."""
    cfg = copy.deepcopy(PER_RANK["desloc"][0])
    cfg["lowcomm"]["desloc"].update(momentum_sync_every=2, variance_sync_every=3, moment_sync_topk=2)
    engine = workers.build_engine(cfg, seed=5)
    syncs, a = engine.optimizer.mode.syncs, engine.optimizer.mode.adamw
    before = {}
    if weights_only:
        workers.train(engine, 3, start=0, rank=rank)
        before = {k: m.anchor.clone() for k, m in syncs.moment_syncs.items()}
    engine.load_checkpoint(save_dir, load_optimizer_states=not weights_only)
    return {"before": before, "anchors": {k: m.anchor.clone() for k, m in syncs.moment_syncs.items()},
            **{k: getattr(a, k).clone() for k in ("exp_avg", "exp_avg_sq")}}


def test_compressed_moment_syncs_resume_from_dense_ones(tmp_path):
    """A checkpoint of dense moment syncs (no anchors) resumed at the same layout with
    moment_sync_topk: each replica keeps its own moments, and both anchors are the replicas'
    mean moments (what a dense sync would have agreed on), read here from the saved files.
    Weights only, into a run that has synced compressed: the moments restart at zero, and their
    anchors with them."""
    numel = run_ranks(_save_per_rank, 2, str(tmp_path), "desloc")[0]
    tag = next(p for p in tmp_path.iterdir() if p.name.startswith("global_step"))
    saved = [torch.load(tag / f"lowcomm_rank{r:05d}.pt", weights_only=True)["shards"] for r in range(2)]
    for r, got in enumerate(run_ranks(_load_with_compressed_moments, 2, str(tmp_path), False)):
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = (s[key][:numel] for s in saved)
            assert not torch.equal(a, b), key
            assert torch.equal(got[key][:numel], saved[r][key][:numel]), key
            assert torch.equal(got["anchors"][key][:numel], (a + b) / 2), key
    for got in run_ranks(_load_with_compressed_moments, 2, str(tmp_path), True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert got["before"][key].abs().sum() > 0, key
            assert got[key].abs().sum() == 0 and got["anchors"][key].abs().sum() == 0, key


def test_a_weights_only_load_applies_the_streamed_sync_in_flight(tmp_path):
    """Weights only from a desloc checkpoint saved with a streamed sync in flight: every rank gets
    replica 0's master plus the sync (its result minus replica 0's master at the launch), read
    here from the saved files, and nothing stays in flight."""
    numel = run_ranks(_save_per_rank, 2, str(tmp_path), "desloc-streamed")[0]
    tag = next(p for p in tmp_path.iterdir() if p.name.startswith("global_step"))
    shards = torch.load(tag / "lowcomm_rank00000.pt", weights_only=True)["shards"]
    want = shards["master"][:numel] - shards["sync_launched"][:numel] + shards["sync_result"][:numel]
    for params, idle in run_ranks(_load_weights_only, 2, str(tmp_path)):
        assert idle and torch.equal(params, want)
        assert not torch.equal(params, shards["master"][:numel])


#: the modes' checkpoint contract: they describe and restore state, and communicate nothing
STATE_METHODS = ("state", "restore")
QUIET_MODES = {**workers.STEP_MODES, "desloc-mid-period": {"shard_group_size": 1, "desloc": {"param_sync_every": 4}}}


def _collectives_in_state_methods(rank, world, tmp):
    """For each mode: 3 steps, a save, a load into a fresh engine (all state, then weights only);
    every collective ds_lowcomm issues is recorded in a CommStats (the training's, the
    checkpoint's): count those issued while a mode's state method runs."""
    from ds_lowcomm.comm.collectives import CommStats

    inside, issued, calls = [0], [], [0]
    record = CommStats.record

    def counting(self, op, *args):
        if inside[0]:
            issued.append(op)
        return record(self, op, *args)

    CommStats.record = counting

    def watch(engine):
        mode = engine.optimizer.mode
        for name in STATE_METHODS:
            method = getattr(mode, name)

            def watched(*args, _method=method, **kwargs):
                inside[0] += 1
                calls[0] += 1
                try:
                    return _method(*args, **kwargs)
                finally:
                    inside[0] -= 1
            setattr(mode, name, watched)
        return engine

    out = {}
    for label, lowcomm in QUIET_MODES.items():
        mode = label.split("-")[0]
        cfg = workers.config(mode, **lowcomm)
        engine = watch(workers.build_engine(cfg))
        workers.train(engine, 3, rank=rank)
        engine.save_checkpoint(f"{tmp}/{label}")
        before = engine.optimizer.flat.buffer.clone()
        fresh = watch(workers.build_engine(cfg, seed=11))
        fresh.load_checkpoint(f"{tmp}/{label}")
        restored = torch.equal(fresh.optimizer.flat.buffer, before)
        weights = watch(workers.build_engine(cfg, seed=12))
        weights.load_checkpoint(f"{tmp}/{label}", load_optimizer_states=False)
        for e in (engine, fresh, weights):
            e.destroy()
        out[label] = (list(issued), restored, calls[0])
        issued.clear()
        calls[0] = 0
    return out


def test_mode_state_methods_communicate_nothing(tmp_path):
    """A save and a load run no collective inside the modes' state methods (the engine settles
    once before each), and each rank's parameters come back as they were: DES-LOC's replica its
    own mid-period, from its files."""
    for res in run_ranks(_collectives_in_state_methods, 2, str(tmp_path), timeout=600):
        for label, (issued, restored, calls) in res.items():
            assert calls >= 4, (label, calls)  # state at the save; restore at each load
            assert issued == [], (label, issued)
            assert restored, label
