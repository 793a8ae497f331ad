"""The bench's command line and its plan: calibrate the link, run every mode at every budget,
write ``results.json`` after each run, then the report. ``python -m ds_lowcomm.bench``."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List

from ds_lowcomm import configs
from ds_lowcomm.bench.analysis import reload_runs, summarize
from ds_lowcomm.bench.link import Link, TwoNodeLink
from ds_lowcomm.bench.report import report, save_results
from ds_lowcomm.bench.runs import (CONFIGS, LOWCOMM_OPTIONS, MODELS, OPTIMIZER_PARAMS, REGIMES, SYNC_STEPS,
                                   TRAINER_BUDGETS, TRAINER_CONFIGS, VARIANTS, _stop_on_sigterm, calibrate,
                                   config_name, is_optimizer_setting, parse_setting, run_one, split_mode,
                                   write_config)
from ds_lowcomm.examples.common import dropout


def _setting(text: str):
    try:
        return parse_setting(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _budgets(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected step counts, e.g. 100,200,400") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive step counts, e.g. 100,200,400")
    return sorted(set(values))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ds_lowcomm.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=None,
                    help=f"comma-separated, from: {', '.join(CONFIGS)} (default ideal,ddp,deepspeed,zero1,acco); "
                         f"--regime uneven-trainer: from {', '.join(TRAINER_CONFIGS)} (default all); "
                         "MODE:KEY=VALUE[:KEY=VALUE...] runs a mode with options of its own, after --set's "
                         "(desloc-streamed:desloc.param_sync_delay=4, ddp:optimizer.lr=0.003; a VALUE holding ':' or "
                         "',' needs --set)")
    ap.add_argument("--regime", choices=REGIMES, default=None,
                    help="a preset link: fast, moderate, slow, uneven, two-node or uneven-trainer (see above)")
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default 2; 4 for two-node)")
    ap.add_argument("--bandwidth", default=None, help="e.g. 100mbit (tc rate syntax); default unlimited, "
                                                      "or the regime's calibrated rate")
    ap.add_argument("--latency", default=None, help="e.g. 5ms added one-way delay")
    ap.add_argument("--model", choices=list(MODELS), default="small")
    ap.add_argument("--dropout", type=dropout, default=None,
                    help="the model's dropout (default: 0.2 for base, nanoGPT's shakespeare-char; else the "
                         "training script's own: 0 for examples/train.py, GPT-2's 0.1 for the Trainer's)")
    ap.add_argument("--steps", type=int, default=None,
                    help="the step budget (unless --budgets; default 60, --regime uneven-trainer "
                         f"{','.join(map(str, TRAINER_BUDGETS))})")
    ap.add_argument("--budgets", type=_budgets, default=None, metavar="N,N,...",
                    help="run every mode at each of these step budgets (schedule included); each "
                         "mode is reported at the one that reached the target soonest")
    ap.add_argument("--target", type=float, default=None,
                    help="target val loss (default: the synchronous baseline's final val loss)")
    ap.add_argument("--target-budget", type=int, default=None, metavar="N",
                    help="the default target is the baseline's final val loss at this budget (one of "
                         "--budgets) instead of its longest: every mode, the baseline included, still "
                         "runs at every budget, so the longer ones give slower methods room to reach it")
    ap.add_argument("--retarget", default=None, metavar="DIR",
                    help="run nothing: recompute a finished bench's time to target (--target or "
                         "--target-budget) from DIR's logs and rewrite its tables and plots")
    ap.add_argument("--evals", type=int, default=10, help="validations per run, at fixed steps")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--gas", type=int, default=4, help="gradient_accumulation_steps (even, for acco)")
    ap.add_argument("--comm-dtype", choices=["fp32", "bf16"], default=None)
    ap.add_argument("--data", default=None, help="text file (default: the built-in corpus)")
    ap.add_argument("--tokenizer", choices=["byte", "char"], default="byte")
    ap.add_argument("--eval-iters", type=int, default=10)
    ap.add_argument("--slow-ranks", "--slow-rank", dest="slow_rank", default=None, metavar="RANK:FACTOR[,...]",
                    help="uneven hardware: these ranks take FACTOR times as long per micro-batch (the "
                         "training scripts' spelling; --slow-rank is kept as an alias)")
    ap.add_argument("--acco-wait", action="store_true",
                    help="acco/dpu wait for the round in flight at each switch instead of computing more "
                         "micro-batches: exactly the tokens per step of zero1, for loss comparisons")
    ap.add_argument("--powersgd-rank", type=int, default=4, help="ddp-powersgd: matrix approximation rank")
    ap.add_argument("--powersgd-warmup", type=int, default=None,
                    help="ddp-powersgd: steps of plain all-reduce first (default: 10%% of the budget, "
                         "at least the LR warm-up, as PyTorch's docs advise)")
    ap.add_argument("--calibration-steps", type=int, default=6,
                    help="steps of the compute-only calibration run of moderate/slow/two-node")
    ap.add_argument("--set", action="append", default=[], type=_setting, metavar="KEY=VALUE",
                    help="override a \"lowcomm\" option, e.g. demo.topk=8, or write the optimizer's lr, betas, eps "
                         "or weight_decay into every mode's config (each mode uses those it has), e.g. "
                         "optimizer.lr=0.003 (JSON value; repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode; the table shows medians")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    if args.dropout is None:
        args.dropout = MODELS[args.model][4]
    trainer = args.regime == "uneven-trainer"
    known = TRAINER_CONFIGS if trainer else CONFIGS
    if args.modes is None:
        args.modes = ",".join(TRAINER_CONFIGS) if trainer else "ideal,ddp,deepspeed,zero1,acco"
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    parsed = {}  # entry: (mode, its own settings)
    for entry in args.mode_list:
        try:
            parsed[entry] = split_mode(entry)
        except ValueError as err:
            ap.error(f"--modes {entry}: {err} after the mode (MODE:KEY=VALUE[:KEY=VALUE...])")
    if len(parsed) < len(args.mode_list):
        ap.error(f"--modes {args.modes}: an entry is named twice; give each its own settings or drop one")
    bad = [mode for mode, _ in parsed.values() if mode not in known]
    if bad:
        ap.error(f"--modes: unknown {', '.join(bad)}{' under --regime uneven-trainer' if trainer else ''}; "
                 f"choose from {', '.join(known)}")
    args.budgets = args.budgets or ([args.steps] if args.steps else list(TRAINER_BUDGETS) if trainer else [60])
    if args.target_budget is not None and args.target is not None:
        ap.error("--target-budget picks the default target: give it or --target, not both")
    if args.target_budget is not None and not args.retarget and args.target_budget not in args.budgets:
        ap.error(f"--target-budget {args.target_budget} must be one of --budgets {args.budgets}")
    if args.evals < 1:
        ap.error(f"--evals: got {args.evals}; must be >= 1")
    if args.regime in ("uneven", "uneven-trainer") and args.slow_rank is None:
        args.slow_rank = "1:3"
    if args.world_size is None:
        args.world_size = 4 if args.regime == "two-node" else 2
    if args.slow_rank:
        try:
            ranks = [int(part.split(":")[0]) for part in args.slow_rank.split(",") if part]
        except ValueError:
            ap.error(f"--slow-ranks {args.slow_rank}: expected RANK:FACTOR[,...], e.g. 1:3")
        outside = [r for r in ranks if not 0 <= r < args.world_size]
        if outside:
            ap.error(f"--slow-ranks names rank {', '.join(map(str, outside))}, but the bench runs ranks "
                     f"0-{args.world_size - 1} (--world-size {args.world_size})")
    if args.regime == "two-node" and (args.world_size < 4 or args.world_size % 2):
        ap.error(f"--regime two-node: --world-size {args.world_size} must be even and >= 4 (2 nodes)")
    if args.regime in ("fast", "uneven", "uneven-trainer") and (args.bandwidth or args.latency):
        ap.error(f"--regime {args.regime} has no link limit; drop --bandwidth/--latency or pick another regime")
    if trainer and args.tokenizer != "byte":
        ap.error("--regime uneven-trainer: examples/finetune_hf.py tokenizes bytes only; drop --tokenizer")
    runs_modes = {m: _lowcomm_mode(m, args.regime) for m in args.mode_list}
    for where, key in [(f"--modes {e}", k) for e, (_, s) in parsed.items() for k, _ in s] + \
            [(f"--set {k}", k) for k, _ in args.set]:
        if is_optimizer_setting(key) and trainer:
            ap.error(f"{where}: --regime uneven-trainer's Trainer builds its own optimizer from its flags; "
                     f"drop {key}")
        if is_optimizer_setting(key) and key.split(".", 1)[1] not in OPTIMIZER_PARAMS:
            ap.error(f"{where}: {key} is not an optimizer setting the bench passes; choose from "
                     f"{', '.join('optimizer.' + p for p in OPTIMIZER_PARAMS)}")
    for entry, (mode, settings) in parsed.items():
        if settings and mode == "ideal":
            ap.error(f"--modes {entry}: ideal (no communication, the pace limit) takes no options; "
                     f"drop them")
        for key, _ in settings:
            if is_optimizer_setting(key):  # checked above, for every config
                continue
            head = key.split(".")[0]
            # an automatic config takes every mode's options, as the user's own keys for that mode
            if runs_modes[entry] is None or ("." in key and head != runs_modes[entry]
                                             and runs_modes[entry] != "automatic"):
                ap.error(f"--modes {entry}: {key} is not an option of its config (it runs "
                         f"{runs_modes[entry] or 'no lowcomm section'}); drop it"
                         + (f", or put it on a {head} mode" if "." in key else ""))
    for key, _ in args.set:
        if is_optimizer_setting(key):
            continue
        head = key.split(".")[0]
        if "." in key and head not in runs_modes.values() and "automatic" not in runs_modes.values():
            ap.error(f"--set {key}: no mode in --modes runs {head!r} (they run "
                     f"{', '.join(sorted({v for v in runs_modes.values() if v})) or 'no lowcomm section'}); "
                     f"add a {head} mode to --modes, or drop --set {key}")
        if not any(runs_modes.values()):
            ap.error(f"--set {key}: no mode in --modes has a \"lowcomm\" section; drop it")
    return args


def _lowcomm_mode(entry: str, regime) -> "str | None":
    """The ds_lowcomm mode that a --modes entry runs (None: a peer without a "lowcomm" section)."""
    name = config_name(entry, regime)  # "ideal" runs zero1's config on single-rank trainings
    if name is None or (regime == "uneven-trainer" and split_mode(entry)[0] == "deepspeed"):
        return None
    return json.loads(Path(configs.path(name)).read_text()).get("lowcomm", {}).get("mode")


def check_runs(args, out: Path) -> None:
    """Every run's config, written as it will run and validated as ds_lowcomm validates it at
    start-up, before the first run: a config one run would refuse ends the bench in one line
    before it spends time on the others."""
    from ds_lowcomm.config import LowCommConfig, LowCommConfigError, check_adamw_hyperparameters, parse
    from ds_lowcomm.modes import MODES

    for steps in args.budgets:
        for mode in args.mode_list:
            path = write_config(mode, args, out, steps)
            cfg = json.loads(path.read_text()) if path is not None else {}
            try:
                if "lowcomm" not in cfg:  # the peers (ddp, stock DeepSpeed): their AdamW's settings
                    if "params" in cfg.get("optimizer", {}):
                        check_adamw_hyperparameters(cfg["optimizer"]["params"], "optimizer.params")
                elif args.regime == "uneven-trainer":  # the Trainer fills the "auto" values from its flags
                    LowCommConfig.from_dict(cfg["lowcomm"], MODES)
                else:
                    parse(cfg, MODES)
            except LowCommConfigError as err:
                raise SystemExit(f"bench: --modes {mode} (at {steps} steps, {path}) would be refused: {err}") from None


def main(argv=None) -> dict:
    args = parse_args(argv)
    command = "python -m ds_lowcomm.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.retarget:
        out = Path(args.retarget)
        config, results = reload_runs(out)
        config["command"] = f"{config['command']}, then {command}"
        return report(config, results, out, args.target, args.target_budget)
    _stop_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_runs(args, out)
    if args.regime in SYNC_STEPS and not args.bandwidth:
        args.bandwidth = calibrate(args, out)
    link = (TwoNodeLink if args.regime == "two-node" else Link)(args.bandwidth, args.latency)
    config = {k: getattr(args, k) for k in ("world_size", "bandwidth", "latency", "model", "dropout", "budgets",
                                           "micro_batch",
                                           "gas", "comm_dtype", "data", "tokenizer", "slow_rank", "acco_wait",
                                           "set", "repeat", "seed", "regime", "evals", "powersgd_rank")}
    config.update(modes=args.mode_list, bandwidth=link.bandwidth, latency=link.latency, steps=max(args.budgets),
                  command=command)
    for entry in args.mode_list:
        mode, own = split_mode(entry)
        if mode != "ideal":
            name = config_name(entry, args.regime)
            changed = VARIANTS.get(mode) or LOWCOMM_OPTIONS.get(mode)
            print(f"{entry}: " + (f"ds_configs/{name}" if name else "no DeepSpeed (the Trainer's DDP)")
                  + (f" with {changed}" if changed else "")
                  + (f", then {dict(own)}" if own else "")
                  + (" without its \"lowcomm\" section" if args.regime == "uneven-trainer" and mode == "deepspeed"
                     else ""), flush=True)
    total = len(args.mode_list) * len(args.budgets) * args.repeat
    done, t_start, results = 0, time.monotonic(), []
    save_results(config, results, out)  # an earlier bench's results.json in --out is not this one's
    try:
        for steps in args.budgets:
            for mode in args.mode_list:
                runs = []
                for rep in range(args.repeat):
                    eta = ""
                    if done:
                        eta = f", ETA {(time.monotonic() - t_start) / done * (total - done) / 60:.1f} min"
                    print(f"[{done + 1}/{total}] {mode}, {steps} steps (run {rep + 1}/{args.repeat}{eta})", flush=True)
                    try:
                        runs.append(run_one(args, mode, link, out, f"{mode}.{steps}.{rep}", steps))
                    except RuntimeError as err:  # a run that ended without its result line
                        if results:
                            report(config, results, out, args.target, args.target_budget)
                        raise SystemExit(f"bench: {mode} at {steps} steps failed ({str(err).splitlines()[0]}); "
                                         f"its log is in {out / 'logs'}; {len(results)} finished run(s) kept in "
                                         f"{out / 'results.json'}") from None
                    done += 1
                results.append(summarize(mode, runs, link.bandwidth, steps))
                save_results(config, results, out)
    finally:
        link.close()
    return report(config, results, out, args.target, args.target_budget)

