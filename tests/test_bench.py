"""The bench at a tiny size: one command, every mode, the documented JSON schema, losses that fall."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"mode": str, "world_size": int, "bandwidth": (str, type(None)), "tokens_per_s": float,
          "step_time_s": float, "exposed_comm_s_per_step": (float, type(None)),
          "bytes_sent_per_rank_per_step": (float, type(None)),
          "bytes_received_per_rank_per_step": (float, type(None)), "link_bytes_per_step": (float, type(None)),
          "final_train_loss": float, "val_loss": float, "peak_rss_mb": float, "tokens": int, "steps": int,
          "seconds_to_target": (float, type(None)), "tokens_to_target": (int, type(None)),
          "step_to_target": (int, type(None))}


def _failure(proc, out: Path) -> str:
    """A failed bench's output, and the tail of each run's log in ``out`` (a run's own traceback is
    there, not in the bench's output)."""
    logs = sorted((out / "logs").glob("*.log")) if (out / "logs").is_dir() else []
    return "\n".join([proc.stdout[-3000:], proc.stderr[-3000:]] +
                     [f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs])


def _val_records(path: Path) -> list:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "val_loss" in r]


@pytest.mark.unit
def test_time_to_target_arithmetic():
    """Synthetic records: linear interpolation between validations, a first validation already
    at the target, a target never reached, training records and the clock (which train.py keeps
    without validation time) taken as they are."""
    from ds_lowcomm.bench.analysis import time_to_target

    recs = [{"step": 1, "train_s": 1.0, "loss": 9.0, "tokens": 100},
            {"step": 2, "train_s": 2.0, "val_loss": 4.0, "tokens": 200},
            {"step": 3, "train_s": 3.0, "loss": 1.0, "tokens": 300},  # a train loss below: ignored
            {"step": 4, "train_s": 6.0, "val_loss": 3.0, "tokens": 400},
            {"step": 6, "train_s": 10.0, "val_loss": 2.0, "tokens": 600}]
    # 2.5 lies halfway between the validations of steps 4 (3.0) and 6 (2.0): 8 s, 500 tokens.
    assert time_to_target(recs, 2.5) == {"seconds": 8.0, "tokens": 500, "step": 6}
    # A quarter of the way from 4.0 (step 2, 2 s) to 3.0 (step 4, 6 s): 3 s, 250 tokens.
    assert time_to_target(recs, 3.75) == {"seconds": 3.0, "tokens": 250, "step": 4}
    assert time_to_target(recs, 3.0) == {"seconds": 6.0, "tokens": 400, "step": 4}  # exactly at it
    assert time_to_target(recs, 5.0) == {"seconds": 2.0, "tokens": 200, "step": 2}  # the first one
    assert time_to_target(recs, 1.5) is None


@pytest.mark.unit
def test_link_rate_arithmetic():
    """moderate: one DDP sync (2(W-1)/W · 4P bytes per rank, all W ranks on one loopback) in one
    step of compute; slow: in ten; two-node: one rank's share per direction of the veth, in ten."""
    from ds_lowcomm.bench.runs import link_rate

    # P = 1e6, W = 2: 4 MB per rank, 8 MB on the loopback; 0.5 s a step -> 128 Mbit/s.
    assert link_rate("moderate", 0.5, 1_000_000, 2) == ("128000kbit", 8e6)
    assert link_rate("slow", 0.5, 1_000_000, 2) == ("12800kbit", 8e6)
    # W = 4: 6 MB per rank crosses each direction between the nodes; 1 s a step, 10 steps.
    assert link_rate("two-node", 1.0, 1_000_000, 4) == ("4800kbit", 6e6)


@pytest.mark.unit
def test_bench_refuses_before_its_first_run(tmp_path, capsys):
    """A --set no selected mode reads, and a config one mode's run would refuse (acco's odd
    accumulation), end the bench in one line before any run starts."""
    from ds_lowcomm.bench import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--modes", "zero1", "--set", "demo.topk=8"])
    assert "--set demo.topk: no mode in --modes runs 'demo' (they run zero1)" in capsys.readouterr().err
    cli.parse_args(["--modes", "zero1,demo", "--set", "demo.topk=8"])  # read by demo
    with pytest.raises(SystemExit):
        cli.parse_args(["--modes", "zero1", "--slow-ranks", "5:3"])
    assert "--slow-ranks names rank 5, but the bench runs ranks 0-1" in capsys.readouterr().err
    assert cli.parse_args(["--slow-rank", "1:2"]).slow_rank == "1:2"  # the old spelling, an alias
    args = cli.parse_args(["--modes", "zero1,acco", "--gas", "3", "--steps", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^bench: --modes acco \(at 2 steps, .*\) would be refused: "
                                         r"gradient_accumulation_steps"):
        cli.check_runs(args, tmp_path)


@pytest.mark.unit
def test_bench_desloc_peers_configs(tmp_path):
    """``diloco`` is DiLoCo's recipe on desloc's replicas (parameters only, outer Nesterov 0.7 /
    0.9 every H steps) and ``desloc-compressed`` sends top-1 of 64 per parameter sync, moments
    never averaged, ``desloc-streamed`` applies each parameter sync 12 steps late, ``desloc-muon``
    takes Muon as the local step; they keep the
    regime's period (the slow-link config's 64 under --regime slow),
    and a --set still overrides them."""
    from ds_lowcomm.bench import cli
    from ds_lowcomm.bench.runs import write_config

    args = cli.parse_args(["--modes", "diloco,desloc-compressed,desloc-streamed,desloc-muon", "--out", str(tmp_path)])
    for mode in args.mode_list:
        write_config(mode, args, tmp_path, 10)
    read = lambda mode: json.loads((tmp_path / "configs" / f"{mode}.10.json").read_text())["lowcomm"]  # noqa: E731
    assert read("diloco")["desloc"] == {"param_sync_every": 16, "momentum_sync_every": 0, "variance_sync_every": 0,
                                        "outer_lr": 0.7, "outer_momentum": 0.9}
    assert read("desloc-compressed")["desloc"] == {"param_sync_every": 16, "momentum_sync_every": 0,
                                                   "variance_sync_every": 0, "sync_topk": 1}
    assert read("desloc-streamed")["desloc"] == {"param_sync_every": 16, "momentum_sync_every": 48,
                                                 "variance_sync_every": 96, "param_sync_delay": 12}
    assert read("desloc-muon")["desloc"] == {"param_sync_every": 16, "momentum_sync_every": 48,
                                             "variance_sync_every": 96, "inner_optimizer": "muon"}
    args = cli.parse_args(["--modes", "desloc-compressed", "--set", "desloc.sync_topk=2", "--out", str(tmp_path)])
    write_config("desloc-compressed", args, tmp_path, 10)
    assert read("desloc-compressed")["desloc"]["sync_topk"] == 2
    slow = cli.parse_args(["--modes", "diloco", "--regime", "slow", "--out", str(tmp_path / "slow")])
    write_config("diloco", slow, tmp_path / "slow", 10)
    assert json.loads((tmp_path / "slow" / "configs" / "diloco.10.json").read_text())[
        "lowcomm"]["desloc"]["param_sync_every"] == 64


@pytest.mark.unit
def test_bench_runs_one_mode_at_several_settings(tmp_path, capsys):
    """``MODE:KEY=VALUE`` entries run one mode at several settings side by side: each entry's
    options go on top of --set's in its own config, named by the whole entry; an option the
    entry's config does not have, a malformed one, or an entry named twice ends the bench in one
    line before any run, as do options on ``ideal`` (no config of its own to run them)."""
    from ds_lowcomm.bench import cli
    from ds_lowcomm.bench.runs import write_config

    entries = ["desloc-streamed", "desloc-streamed:desloc.param_sync_delay=4",
               "desloc-streamed:desloc.param_sync_delay=8:desloc.param_sync_every=32"]
    args = cli.parse_args(["--modes", ",".join(entries), "--regime", "slow", "--set", "desloc.param_sync_every=16",
                           "--out", str(tmp_path)])
    assert args.mode_list == entries
    for entry in entries:
        write_config(entry, args, tmp_path, 10)
    desloc = [json.loads((tmp_path / "configs" / f"{e}.10.json").read_text())["lowcomm"]["desloc"] for e in entries]
    # desloc_slow_link.json's periods (64, 192, 384), --set's 16, then each entry's own
    assert [(d["param_sync_every"], d["param_sync_delay"]) for d in desloc] == [(16, 12), (16, 4), (32, 8)]
    assert {d["momentum_sync_every"] for d in desloc} == {192}
    # an automatic entry, or --set, puts a mode's options into that mode's sub-object (the user's
    # own keys there); the other modes' configs keep theirs
    auto = cli.parse_args(["--modes", "automatic:desloc.inner_optimizer=muon,automatic,demo", "--regime", "slow",
                           "--set", "desloc.param_sync_every=32", "--out", str(tmp_path)])
    written = [json.loads(write_config(e, auto, tmp_path, 10).read_text())["lowcomm"] for e in auto.mode_list]
    assert [w["mode"] for w in written] == ["automatic", "automatic", "demo"]
    assert written[0]["desloc"] == {"param_sync_every": 32, "inner_optimizer": "muon"}
    assert written[1]["desloc"] == {"param_sync_every": 32} and "desloc" not in written[2]
    for argv, message in [
            (["--modes", "zero1,desloc:demo.topk=8"], "--modes desloc:demo.topk=8: demo.topk is not an option of "
                                                      "its config (it runs desloc)"),
            (["--modes", "ddp:comm_dtype=bf16"], "--modes ddp:comm_dtype=bf16: comm_dtype is not an option of its "
                                                 "config (it runs no lowcomm section); drop it\n"),
            (["--modes", "ideal:comm_dtype=bf16"], "ideal (no communication, the pace limit) takes no options"),
            (["--modes", "desloc:param_sync_every"], "--modes desloc:param_sync_every: 'param_sync_every': expected "
                                                     "KEY=VALUE"),
            (["--modes", "desloc,desloc"], "an entry is named twice"),
            (["--modes", "ddp:optimizer.momentum=0.9"], "--modes ddp:optimizer.momentum=0.9: optimizer.momentum is "
                                                        "not an optimizer setting the bench passes; choose from "
                                                        "optimizer.lr, optimizer.betas"),
            (["--regime", "uneven-trainer", "--set", "optimizer.lr=0.003"],
             "--set optimizer.lr: --regime uneven-trainer's Trainer builds its own optimizer"),
            (["--modes", "deslok:desloc.param_sync_every=4"], "--modes: unknown deslok")]:
        with pytest.raises(SystemExit):
            cli.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.unit
def test_bench_runs_each_mode_at_its_own_learning_rate(tmp_path):
    """``optimizer.lr`` sets the learning rate in an entry's config, the DDP peer's included (it has
    no "lowcomm" section; examples/train_ddp.py builds its AdamW from the config), and ``--set
    optimizer.lr`` in every mode's, under an entry's own: so a bench compares methods each at its
    best learning rate. A peer's value torch's AdamW would refuse ends the bench before any run."""
    from ds_lowcomm.bench import cli
    from ds_lowcomm.bench.runs import write_config

    entries = ["ddp", "ddp:optimizer.lr=0.003", "desloc-muon:optimizer.lr=0.004:desloc.param_sync_delay=4"]
    lrs = lambda args: [json.loads(write_config(e, args, tmp_path, 10).read_text())["optimizer"]["params"]["lr"]  # noqa: E731
                        for e in entries]
    assert lrs(cli.parse_args(["--modes", ",".join(entries), "--regime", "slow", "--out", str(tmp_path)])) \
        == [0.001, 0.003, 0.004]  # the shipped ddp config's 0.001, then each entry's own
    args = cli.parse_args(["--modes", ",".join(entries), "--regime", "slow", "--set", "optimizer.lr=0.002",
                           "--set", "optimizer.betas=[0.9,0.99]", "--out", str(tmp_path)])
    assert lrs(args) == [0.002, 0.003, 0.004]
    written = json.loads((tmp_path / "configs" / f"{entries[2]}.10.json").read_text())
    assert written["optimizer"]["params"]["betas"] == [0.9, 0.99]
    assert written["lowcomm"]["desloc"]["param_sync_delay"] == 4
    # the peers alone (no "lowcomm" section in the run) take it too
    peers = cli.parse_args(["--modes", "ddp,deepspeed", "--set", "optimizer.lr=0.002", "--out", str(tmp_path)])
    assert [json.loads(write_config(e, peers, tmp_path, 10).read_text())["optimizer"]["params"]["lr"]
            for e in ("ddp", "deepspeed")] == [0.002, 0.002]
    # a peer's AdamW setting that torch would refuse ends the bench before its first run
    bad = cli.parse_args(["--modes", "ddp:optimizer.lr=-1,zero1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^bench: --modes ddp:optimizer.lr=-1 \(at 60 steps, .*\) would be "
                                         r"refused: optimizer.params.lr: got -1; must be a number >= 0"):
        cli.check_runs(bad, tmp_path)


@pytest.mark.unit
def test_bench_base_is_nanogpts_shakespeare_char_model(tmp_path, capsys):
    """``--model base`` is nanoGPT's shakespeare-char model, 6 layers × 384 wide, 6 heads, a context
    of 256 and dropout 0.2, passed to each training script the bench launches (examples/train.py,
    its DDP twin, the Trainer's example); the other models leave each script its own dropout;
    ``--dropout`` overrides either; outside [0, 1) it ends the bench in one line. Both scripts build
    their default model with it (the Trainer's example GPT-2's own 0.1 without it), and the
    Trainer's example refuses it for a pretrained ``--model``."""
    from ds_lowcomm.bench import cli
    from ds_lowcomm.bench.link import Link
    from ds_lowcomm.bench.runs import train_command, trainer_command

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1] if name in cmd else None

    for extra, want in (([], None), (["--model", "base"], "0.2"), (["--model", "base", "--dropout", "0"], "0.0"),
                        (["--dropout", "0.1"], "0.1")):
        args = cli.parse_args(["--modes", "zero1,ddp", "--out", str(tmp_path), *extra])
        cmds = [train_command(args, mode, tmp_path / "c.json", 2, tmp_path / "l.jsonl", "", Link(None, None), 10)
                for mode in ("zero1", "ddp")]
        trainer = cli.parse_args(["--regime", "uneven-trainer", "--out", str(tmp_path), *extra])
        cmds.append(trainer_command(trainer, None, tmp_path / "l.jsonl", 10, tmp_path / "o"))
        for cmd in cmds:
            assert flag(cmd, "--dropout") == want, (extra, cmd)
            if "base" in extra:
                assert [flag(cmd, f) for f in ("--n-layer", "--n-head", "--n-embd", "--block-size")] == \
                    ["6", "6", "384", "256"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--dropout", "1", "--out", str(tmp_path)])
    assert "--dropout: got 1; must be in [0, 1)" in capsys.readouterr().err
    sys.path.insert(0, str(ROOT / "examples"))
    import finetune_hf
    import torch
    import train

    built = train.build_model(train.parse_args(["--deepspeed", "zero1", "--dropout", "0.2"]), 65).config
    assert (built.resid_pdrop, built.embd_pdrop, built.attn_pdrop) == (0.2, 0.2, 0.2)
    for argv, want in (([], 0.1), (["--dropout", "0.2"], 0.2)):  # GPT-2's own 0.1 without the flag
        model = finetune_hf.default_model(finetune_hf.parse_args(argv), finetune_hf.ByteTokenizer())
        assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {want}, argv
    with pytest.raises(SystemExit):
        finetune_hf.parse_args(["--dropout", "0.2", "--model", "gpt2"])
    assert "--dropout applies to the default model" in capsys.readouterr().err


@pytest.mark.unit
def test_bench_keeps_finished_runs_when_one_fails(tmp_path, monkeypatch):
    """results.json after every run: a run that dies leaves the finished ones on disk, and the
    bench ends in one line naming the run (here the runs themselves are recorded, not trained)."""
    from ds_lowcomm.bench import cli

    stop = [RuntimeError]

    def run_one(args, mode, link, out, label, steps):
        if mode == "acco":
            raise stop[0](f"{label}: no JSON result line in the output:\n...")
        return {"mode": mode, "world_size": 2, "steps": steps, "tokens_per_s": 1.0, "step_time_s": 1.0,
                "val_loss": 3.0, "final_train_loss": 3.0, "tokens": 10, "records": [], "peak_rss_mb": 1.0}

    monkeypatch.setattr(cli, "run_one", run_one)
    monkeypatch.setattr(cli, "report", lambda config, results, out, *a: cli.save_results(config, results, out))
    with pytest.raises(SystemExit, match=r"^bench: acco at 2 steps failed \(acco.2.0: no JSON result line"):
        cli.main(["--modes", "zero1,demo,acco", "--steps", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in saved["runs"]] == ["zero1", "demo"]
    # Stopped outright (Ctrl-C here; a kill leaves the same file): what finished is on disk.
    (tmp_path / "results.json").unlink()
    stop[0] = KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--modes", "zero1,demo,acco", "--steps", "2", "--out", str(tmp_path)])
    assert [r["mode"] for r in json.loads((tmp_path / "results.json").read_text())["runs"]] == ["zero1", "demo"]


@pytest.mark.integration
def test_bench_tiny(tmp_path):
    """`--regime fast` (no link limit) with a tiny model, every mode and peer."""
    modes = ["ideal", "ddp", "ddp-powersgd", "deepspeed", "zero1", "acco", "dpu", "zero1-overlap"]
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench", "--regime", "fast", "--modes", ",".join(modes),
                           "--model", "tiny", "--steps", "5", "--eval-iters", "2", "--evals", "5",
                           "--powersgd-rank", "1", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    assert "[1/8] ideal" in proc.stdout and "[8/8] zero1-overlap" in proc.stdout
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in result["runs"]] == modes
    assert result["config"]["steps"] == 5 and result["config"]["world_size"] == 2
    for run in result["runs"]:
        for key, types in SCHEMA.items():
            assert isinstance(run[key], types), (run["mode"], key, run[key])
        assert run["steps"] == 5 and run["world_size"] == 2 and run["tokens"] > 0
    by_mode = {r["mode"]: r for r in result["runs"]}
    assert by_mode["ideal"]["bytes_sent_per_rank_per_step"] == 0
    # acco (fp32 model) per step: a real round (zero1's fp32 reduce-scatter, its all-gather a bf16
    # change: 6 bytes of zero1's 8) and an estimate round all in bf16 (4), plus small all-reduces
    assert by_mode["acco"]["bytes_sent_per_rank_per_step"] == pytest.approx(
        10 / 8 * by_mode["zero1"]["bytes_sent_per_rank_per_step"], rel=0.02)
    # zero1-overlap is zero1 with its reduce-scatter overlapped: the same training exactly.
    cfg = json.loads((tmp_path / "configs" / "zero1-overlap.5.json").read_text())
    assert cfg["lowcomm"]["zero1"] == {"overlap": True}
    for key in ("val_loss", "final_train_loss", "bytes_sent_per_rank_per_step"):
        assert by_mode["zero1-overlap"][key] == by_mode["zero1"][key], key
    # Every mode's loss fell: first logged step vs the end.
    # The default target is DDP's final val loss (+ 1e-4 for float rounding); each run reaches it
    # by its first validation at or below it (read here from the run's own log), no later than
    # that validation's clock.
    target = result["config"]["target"]
    assert target == pytest.approx(by_mode["ddp"]["val_loss"] * 1.0001, rel=1e-12)
    assert "ddp's final val loss" in result["config"]["target_source"]
    assert result["config"]["regime"] == "fast" and result["config"]["bandwidth"] is None
    for mode in modes[1:]:
        vals = _val_records(tmp_path / "logs" / f"{mode}.5.0.jsonl")
        assert [v["step"] for v in vals] == [1, 2, 3, 4, 5]
        i = next((i for i, v in enumerate(vals) if v["val_loss"] <= target), None)
        run = by_mode[mode]
        assert run["step_to_target"] == (vals[i]["step"] if i is not None else None), mode
        if i is not None:
            lo = vals[i - 1]["train_s"] if i else vals[i]["train_s"]
            assert lo <= run["seconds_to_target"] <= vals[i]["train_s"], mode
    assert by_mode["ddp"]["step_to_target"] is not None
    # Stock ZeRO-1 and DDP train the same model the same way: the same target, the same step.
    assert by_mode["deepspeed"]["val_loss"] == pytest.approx(by_mode["ddp"]["val_loss"], rel=1e-5)
    # ... so the exact modes reach the target where DDP does, float rounding notwithstanding
    assert by_mode["deepspeed"]["step_to_target"] == by_mode["zero1"]["step_to_target"] == by_mode["ddp"]["step_to_target"]
    for mode in modes:
        log = tmp_path / "logs" / (f"{mode}.5.0.rank0.jsonl" if mode == "ideal" else f"{mode}.5.0.jsonl")
        first = json.loads(log.read_text().splitlines()[0])["loss"]
        assert by_mode[mode]["final_train_loss"] < first - 0.05, (mode, first, by_mode[mode]["final_train_loss"])
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {m} |" in table for m in modes) and "seconds to target" in table


@pytest.mark.integration
def test_bench_budget_sweep(tmp_path):
    """Each budget is its own run with its own schedule; a mode is reported at the budget that
    reached the target soonest; --target overrides the default."""
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench", "--modes", "ddp,zero1", "--model", "tiny",
                           "--budgets", "4,2", "--eval-iters", "2", "--evals", "2", "--target", "5.45",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    result = json.loads((tmp_path / "results.json").read_text())
    assert [(r["mode"], r["steps"]) for r in result["runs"]] == [("ddp", 2), ("zero1", 2), ("ddp", 4), ("zero1", 4)]
    for r in result["runs"]:
        cfg = json.loads((tmp_path / "configs" / f"{r['mode']}.{r['steps']}.json").read_text())
        assert cfg["scheduler"]["params"]["total_num_steps"] == r["steps"]
    assert result["config"]["target"] == 5.45 and result["config"]["target_source"] == "--target"
    for mode in ("ddp", "zero1"):
        mine = [r for r in result["runs"] if r["mode"] == mode and r["seconds_to_target"] is not None]
        best = next(b for b in result["best"] if b["mode"] == mode)
        if mine:
            assert best["seconds_to_target"] == min(r["seconds_to_target"] for r in mine)
        else:
            assert best["seconds_to_target"] is None and best["steps"] == 4
    # --retarget: nothing runs again; the target becomes DDP's final val loss at the 2-step budget
    # and every run's time to it is read back from its own log.
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench", "--retarget", str(tmp_path),
                           "--target-budget", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    again = json.loads((tmp_path / "results.json").read_text())
    ddp2 = next(r for r in result["runs"] if (r["mode"], r["steps"]) == ("ddp", 2))
    target = again["config"]["target"]
    assert target == pytest.approx(ddp2["val_loss"] * 1.0001, rel=1e-12)
    assert again["config"]["target_source"] == "ddp's final val loss at 2 steps + 0.0001"
    assert "--retarget" in again["config"]["command"] and "--budgets 4,2" in again["config"]["command"]
    for r in again["runs"]:
        vals = _val_records(tmp_path / "logs" / f"{r['mode']}.{r['steps']}.0.jsonl")
        first = next((i for i, v in enumerate(vals) if v["val_loss"] <= target), None)
        if first is None:
            assert r["seconds_to_target"] is None, r
        else:  # between the validation before and the first at or below the target
            low = vals[first - 1]["train_s"] if first else vals[first]["train_s"]
            assert low <= r["seconds_to_target"] <= vals[first]["train_s"], r
            assert r["step_to_target"] == vals[first]["step"]
    assert next(r for r in again["runs"] if (r["mode"], r["steps"]) == ("ddp", 2))["seconds_to_target"] is not None


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"),
                    reason="a private network namespace needs root and iproute2")
def test_link_bytes_match_accounting(tmp_path):
    """What crossed the (namespace) link equals the library's byte accounting within 10%.

    acco counts the round it launches at the last switch, so its per-step accounting runs ~1/(2 steps)
    high; 10 steps keep that edge effect at 5%.
    """
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench", "--modes", "deepspeed,zero1,acco,demo,desloc",
                           "--model", "small", "--steps", "10", "--eval-iters", "1", "--bandwidth", "10gbit",
                           "--set", "desloc.param_sync_every=2", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    runs = {r["mode"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    for mode in ("zero1", "acco", "demo", "desloc"):
        ours, link = runs[mode]["bytes_sent_per_rank_per_step"], runs[mode]["link_bytes_per_step"]
        assert abs(link - ours) <= 0.10 * ours, (mode, ours, link)
    # Stock ZeRO-1 all-reduces the full gradient: 1.5x zero1's bytes on the wire.
    assert runs["deepspeed"]["link_bytes_per_step"] >= 1.4 * runs["zero1"]["link_bytes_per_step"]


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"),
                    reason="two network namespaces need root and iproute2")
def test_two_node_regime(tmp_path):
    """4 ranks as 2 nodes: calibrated, DeMo sharded inside a node (shard_group_size 2), and the
    inter-node link (veth counters) carrying less for DeMo than for DDP."""
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench", "--regime", "two-node", "--modes", "ddp,demo",
                           "--model", "tiny", "--steps", "3", "--eval-iters", "1", "--evals", "1",
                           "--calibration-steps", "2", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["regime"] == "two-node" and result["config"]["world_size"] == 4
    assert "calibration:" in proc.stdout and result["config"]["bandwidth"].endswith("kbit")
    demo = json.loads((tmp_path / "configs" / "demo.3.json").read_text())["lowcomm"]
    assert demo["shard_group_size"] == 2
    assert demo["demo"]["topk"] == 256  # the regime runs ds_configs/demo_slow_link.json
    runs = {r["mode"]: r for r in result["runs"]}
    assert all(r["world_size"] == 4 for r in runs.values())
    assert 0 < runs["demo"]["link_bytes_per_step"] < runs["ddp"]["link_bytes_per_step"]


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"), reason="the namespace needs root and iproute2")
def test_sigterm_stops_the_runs_and_removes_the_namespace(tmp_path):
    """A bench killed mid-run (a scheduler's SIGTERM) leaves no training process and no namespace."""
    proc = subprocess.Popen([sys.executable, "-m", "ds_lowcomm.bench", "--modes", "zero1", "--model", "tiny",
                             "--steps", "500", "--evals", "1", "--bandwidth", "10mbit", "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # until training is under way
        if "] step " in line:
            break
    proc.send_signal(signal.SIGTERM)
    proc.stdout.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"lowcomm-bench-{proc.pid}" not in namespaces
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert left == [], left


# Checkpoint bytes per parameter, fp32, 2 ranks (the shipped demo/desloc configs: one rank per
# replica): the model file's weights (4) + fp32 master and two Adam moments (12) for stock and
# zero1; acco adds each rank's full fp32 gradient accumulator (2 × 4) and its round's result
# (4, sharded); demo saves the master and δ per replica (2 × 8); desloc θ, m, v per replica (2 × 12).
CHECKPOINT_BYTES_PER_PARAM = {"deepspeed": 16, "zero1": 16, "acco": 28, "demo": 20, "desloc": 28}


@pytest.mark.integration
def test_checkpoint_bench_tiny(tmp_path):
    # --async-save: every mode's background save is published complete (the files and weights below)
    labels = list(CHECKPOINT_BYTES_PER_PARAM)
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench.checkpoint", "--model", "tiny", "--async-save",
                           "--configs", ",".join(labels), "--bandwidth", "none", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    rows = {r["label"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert list(rows) == labels and (tmp_path / "results.md").is_file()
    for label, per_param in CHECKPOINT_BYTES_PER_PARAM.items():
        r = rows[label]
        assert r["weights_restored"] and r["save_s"] > 0 and r["load_s"] > 0, label
        assert r["published_s"] >= r["save_s"], label
        # the formula, plus metadata (pickle and zip headers, DeepSpeed's config: tens of kB)
        assert per_param * r["params"] <= r["checkpoint_bytes"] <= per_param * r["params"] + 80_000, (
            label, r["checkpoint_bytes"] / r["params"])


@pytest.mark.integration
def test_bench_uneven_trainer_tiny(tmp_path):
    """`--regime uneven-trainer`: the Hugging Face Trainer (examples/finetune_hf.py) with rank 1 3x
    slower: zero1 paced by the fastest rank, zero1-slowest and the Trainer's DDP run (acco and stock
    DeepSpeed differ from zero1 only by their configs, written here without a run), the results
    schema, and the default target from zero1-slowest."""
    from ds_lowcomm.bench.cli import parse_args
    from ds_lowcomm.bench.runs import write_config

    modes = ["zero1", "zero1-slowest", "ddp"]
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.bench", "--regime", "uneven-trainer", "--model", "tiny",
                           "--modes", ",".join(modes),
                           "--budgets", "2", "--micro-batch", "2", "--gas", "2", "--eval-iters", "1", "--evals", "2",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _failure(proc, tmp_path)
    assert "ddp: no DeepSpeed (the Trainer's DDP)" in proc.stdout
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in result["runs"]] == modes
    config = result["config"]
    assert config["regime"] == "uneven-trainer" and config["slow_rank"] == "1:3" and config["bandwidth"] is None
    for run in result["runs"]:
        for key, types in SCHEMA.items():
            assert isinstance(run[key], types), (run["mode"], key, run[key])
        assert run["steps"] == 2 and run["world_size"] == 2 and run["tokens"] == 2 * 2 * 2 * 2 * 32
        log = (tmp_path / "logs" / f"{run['mode']}.2.0.log").read_text()
        assert "rank 1: slowed down 3x" in log, run["mode"]
        # train.py's records: a validation every step (1/2 of 2), off the training clock
        vals = _val_records(tmp_path / "logs" / f"{run['mode']}.2.0.jsonl")
        assert [v["step"] for v in vals] == [1, 2] and vals[0]["train_s"] <= vals[1]["train_s"], run["mode"]
        assert vals[-1]["val_loss"] == run["val_loss"] and vals[-1]["tokens"] == run["tokens"]
    by_mode = {r["mode"]: r for r in result["runs"]}
    # the lowcomm modes report their bytes; the peers have no accounting
    assert by_mode["zero1"]["bytes_sent_per_rank_per_step"] > 0
    assert by_mode["ddp"]["bytes_sent_per_rank_per_step"] is None
    # the configs: zero1-slowest is hf/zero1.json paced by the slowest rank; deepspeed drops "lowcomm"
    cfg = lambda mode: json.loads((tmp_path / "configs" / f"{mode}.2.json").read_text())
    assert cfg("zero1-slowest")["lowcomm"] == {"mode": "zero1", "pace": "slowest"}
    assert "pace" not in cfg("zero1")["lowcomm"]
    args = parse_args(["--regime", "uneven-trainer", "--out", str(tmp_path / "unrun")])
    for mode in ("acco", "deepspeed"):
        write_config(mode, args, tmp_path, 2)
    assert cfg("acco")["lowcomm"]["mode"] == "acco" and "lowcomm" not in cfg("deepspeed")
    assert args.mode_list == ["zero1", "zero1-slowest", "acco", "deepspeed", "ddp"]  # the regime's default
    assert not (tmp_path / "configs" / "ddp.2.json").exists()
    assert config["target"] == pytest.approx(by_mode["zero1-slowest"]["val_loss"] * 1.0001, rel=1e-12)
    assert config["target_source"].startswith("zero1-slowest's final val loss")
    assert by_mode["zero1-slowest"]["step_to_target"] == 2
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {m} |" in table for m in modes) and "vs zero1-slowest" in table


@pytest.mark.unit
def test_bench_keeps_a_failed_runs_log(tmp_path):
    """A run that exits non-zero leaves its whole output in its log, where the bench's one-line
    failure message sends the user (before, only a finished run's log was written)."""
    from ds_lowcomm.bench.runs import _follow

    script = "print('step 1/2 | loss 5.0'); import sys; print('Traceback: boom', file=sys.stderr); sys.exit(3)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log = tmp_path / "run.log"
    with pytest.raises(RuntimeError, match=r"^run: training exited with 3:"):
        _follow(proc, "run", log, quiet=True)
    assert log.read_text().splitlines() == ["step 1/2 | loss 5.0", "Traceback: boom"]
    # the one-line message names the run's own error: the last line naming one, torchrun's
    # closing ChildFailedError passed over
    from ds_lowcomm.bench.runs import last_error
    torchrun = ("step 2/2 | loss 4.9\n[rank1]: Traceback (most recent call last):\n"
                "[rank1]:   File \"finetune_hf.py\", line 3, in <module>\n"
                "[rank1]: RuntimeError: Connection closed by peer\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "============================================================\n")
    assert last_error(torchrun) == "[rank1]: RuntimeError: Connection closed by peer"
    assert last_error("error: --resume: no checkpoint in ckpt/\n") == "error: --resume: no checkpoint in ckpt/"
    assert last_error("usage: train.py [-h]\ntrain.py: error: unrecognized arguments: --gas 2\n") == \
        "train.py: error: unrecognized arguments: --gas 2"
    assert last_error("step 1/2 | loss 5.0\n") == ""
    script = script.replace("Traceback: boom", "ValueError: boom")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    with pytest.raises(RuntimeError, match=r"^run: training exited with 3: ValueError: boom\n"):
        _follow(proc, "run", log, quiet=True)


@pytest.mark.ranks
def test_checkpoint_bench_names_a_failed_runs_error(tmp_path):
    """The checkpoint bench's failure message names the run's own last error too: here its
    worker's flags, refused by the worker itself under torchrun."""
    from ds_lowcomm.bench import checkpoint
    from ds_lowcomm.bench.link import Link

    args = checkpoint.parse_args(["--model", "tiny", "--out", str(tmp_path)])
    args.model = "no-such-model"
    with pytest.raises(RuntimeError, match=r"^zero1: exited with \d+: .*error: argument --model: invalid choice: "
                                           r"'no-such-model'.*; log: "):
        checkpoint.run_config(args, "zero1", Link(None, None), tmp_path, 0)
