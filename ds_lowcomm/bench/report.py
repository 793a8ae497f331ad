"""The bench's tables (``results.md``) and plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from ds_lowcomm.bench.analysis import BASELINES, PEERS, TRAINER_BASELINES, apply_target, best_per_mode, default_target


def _fmt(x, spec, unit=""):
    return "–" if x is None else format(x, spec) + unit


def _ratio(r: dict, peer: Optional[dict]) -> str:
    if peer is None or r["seconds_to_target"] is None or peer["seconds_to_target"] is None:
        return "–"
    return f"{r['seconds_to_target'] / peer['seconds_to_target']:.2f}×"


def markdown(config: dict, runs: List[dict]) -> str:
    best = best_per_mode(runs)
    by_mode = {r["mode"]: r for r in best}
    peers = [p for p in (TRAINER_BASELINES if config.get("regime") == "uneven-trainer" else PEERS) if p in by_mode]
    head = ("| mode | best budget (steps) | seconds to target | tokens to target | "
            + "".join(f"vs {p} | " for p in peers) + "final val loss | link MB/rank/step |")
    # seconds/tokens to target are interpolated between validations; "(by step N)": the first
    # validation at or below the target
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in best:
        link = r["link_bytes_per_step"]
        reached = r["seconds_to_target"] is not None
        # ideal's W trainings each see 1/W of the batch: a pace, not a time to this target
        missed = "pace only | – | " if r["mode"] == "ideal" else "not reached | – | "
        rows.append(f"| {r['mode']} | {r['steps']} | "
                    + (f"{r['seconds_to_target']:.1f} (by step {r['step_to_target']}) | {r['tokens_to_target']:,} | "
                       if reached else missed)
                    + "".join(f"{_ratio(r, by_mode[p])} | " for p in peers)
                    + f"{r['val_loss']:.4f} | {_fmt(link / 1e6 if link is not None else None, '.3f')} |")
    at = lambda mode, steps: next((o for o in runs if o["mode"] == mode and o["steps"] == steps), None)
    head2 = ("| mode | steps | tokens/s | vs deepspeed | vs ideal | step s | exposed comm s/step | "
             "MB sent/rank/step | link MB/rank/step | final train loss | val loss | s to target | peak RSS MB |")
    rows2 = [head2, "|" + "---|" * (head2.count("|") - 1)]
    for r in runs:
        stock, ideal = at("deepspeed", r["steps"]), at("ideal", r["steps"])
        vs_stock = r["tokens_per_s"] / stock["tokens_per_s"] if stock else None
        vs_ideal = r["tokens_per_s"] / ideal["tokens_per_s"] if ideal else None
        mb, link = r["bytes_sent_per_rank_per_step"], r["link_bytes_per_step"]
        rows2.append(f"| {r['mode']} | {r['steps']} | {r['tokens_per_s']:,.0f} | {_fmt(vs_stock, '.2f', '×')} | "
                     f"{_fmt(vs_ideal, '.2f', '×')} | {r['step_time_s']:.3f} | "
                     f"{_fmt(r['exposed_comm_s_per_step'], '.3f')} | {_fmt(mb / 1e6 if mb is not None else None, '.3f')} | "
                     f"{_fmt(link / 1e6 if link is not None else None, '.3f')} | {r['final_train_loss']:.4f} | "
                     f"{r['val_loss']:.4f} | {_fmt(r['seconds_to_target'], '.1f')} | {_fmt(r['peak_rss_mb'], '.0f')} |")
    c = config
    target = (f"target val loss {c['target']:.4f} ({c['target_source']})" if c.get("target") is not None
              else "no target (no synchronous baseline run and no --target)")
    return (f"# ds_lowcomm bench\n\n{c['world_size']} ranks, model `{c['model']}`, budgets {c['budgets']} steps, "
            f"micro-batch {c['micro_batch']} × accumulation {c['gas']}, regime {c['regime'] or 'custom'}, link "
            f"{c['bandwidth'] or 'unlimited'}{' + ' + c['latency'] if c['latency'] else ''}"
            f"{' between 2 nodes' if c['regime'] == 'two-node' else ''}, "
            f"slow ranks: {c['slow_rank'] or 'none'}, "
            f"{'the Hugging Face Trainer (examples/finetune_hf.py), ' if c['regime'] == 'uneven-trainer' else ''}"
            f"medians over {c['repeat']} run(s); {target}; "
            f"validation every 1/{c['evals']} of a run, off the clock.\n\n"
            f"Command: `{c['command']}`\n\n"
            f"Time to target, each mode at its best budget (seconds of training; ratios < 1: faster than the peer):\n\n"
            + "\n".join(rows) + "\n\nEvery run:\n\n" + "\n".join(rows2) + "\n")


def plots(runs: List[dict], out: Path, target: Optional[float]) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed, no plots (pip install '.[bench]' or matplotlib)", flush=True)
        return []
    made = []
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in runs:
        vals = [x for x in r["records"] if "val_loss" in x]
        a.plot([x["train_s"] for x in vals], [x["val_loss"] for x in vals], marker=".",
               label=f"{r['mode']} ({r['steps']} steps)")
    # Best loss against wall time: per mode, the lowest val loss any of its budgets had reached
    # by then (the budget a user would have picked, knowing the answer).
    for mode in dict.fromkeys(r["mode"] for r in runs):
        pts = sorted((x["train_s"], x["val_loss"]) for r in runs if r["mode"] == mode
                     for x in r["records"] if "val_loss" in x)
        env, lo = [], float("inf")
        for t, v in pts:
            lo = min(lo, v)
            env.append((t, lo))
        b.step([t for t, _ in env], [v for _, v in env], where="post", label=mode)
    for ax, title in ((a, "val loss vs training time, every run"), (b, "best val loss over budgets vs time")):
        if target is not None:
            ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set(xlabel="training seconds (validation excluded)", ylabel="val loss", title=title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    made.append("loss.png")

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{r['mode']}@{r['steps']}" for r in runs]
    x = list(range(len(runs)))
    # A value a run did not measure (the peers have no library accounting; no namespace, no link
    # counters) is written "not measured" where its bar would be, never drawn as zero or one.
    exposed = [r["exposed_comm_s_per_step"] for r in runs]
    total = [r["step_time_s"] for r in runs]
    compute = [t - (e or 0.0) for t, e in zip(total, exposed)]
    a.bar(x, compute, label="compute (and hidden comm)")
    a.bar(x, [e or 0.0 for e in exposed], bottom=compute, label="exposed comm")
    for i, e in enumerate(exposed):
        if e is None:
            a.annotate("comm not measured", (i, total[i] / 2), ha="center", va="center", fontsize=6, rotation=90,
                       color="white")
    a.set(ylabel="seconds per step", title="time per step")
    a.legend()
    sent = [r["link_bytes_per_step"] if r["link_bytes_per_step"] is not None else r["bytes_sent_per_rank_per_step"]
            for r in runs]
    b.bar([i for i, v in zip(x, sent) if v], [v for v in sent if v])
    b.set_yscale("log")
    for i, v in enumerate(sent):
        if not v:
            b.annotate("not measured" if v is None else "none", (i, 0.03), xycoords=("data", "axes fraction"),
                       ha="center", va="bottom", fontsize=6, rotation=90)
    b.set(ylabel="bytes per rank per step (link, else accounting)", title="bytes per step (log)")
    for ax in (a, b):
        ax.set_xticks(x, names)
        ax.set_xlim(-0.5, len(runs) - 0.5)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_time_and_bytes.png", dpi=110)
    made.append("step_time_and_bytes.png")
    plt.close("all")
    return made


def save_results(config: dict, results: List[dict], out: Path) -> dict:
    """``results.json`` of the runs so far (written after every run, so a bench stopped midway
    keeps what it finished: ``--retarget`` reports from it); returns what it wrote."""
    drop = ("records", "all_records")
    payload = {"config": config, "runs": [{k: v for k, v in r.items() if k not in drop} for r in results],
               "best": [{k: v for k, v in r.items() if k not in drop} for r in best_per_mode(results)]}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    return payload


def report(config: dict, results: List[dict], out: Path, target: Optional[float],
           target_budget: Optional[int]) -> dict:
    """Time to target for every run, then results.json, results.md and the plots in ``out``."""
    config.pop("target", None)
    if target is not None:
        config.update(target=target, target_source="--target")
    elif (found := default_target(results, target_budget, TRAINER_BASELINES if config.get("regime") == "uneven-trainer"
                                  else BASELINES)) is not None:
        config.update(target=found[0], target_source=found[1])
    if config.get("target") is not None:
        apply_target(results, config["target"])
    payload = save_results(config, results, out)
    table = markdown(config, results)
    (out / "results.md").write_text(table)
    made = plots(results, out, config.get("target"))
    print("\n" + table, flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {out / m}" for m in made),
          flush=True)
    return payload
