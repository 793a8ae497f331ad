"""From runs to answers: time to a target loss, the default target, medians over repeats, and
each mode's best budget."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import List, Optional, Tuple


#: the synchronous baselines whose final val loss is the default target, in order of preference
BASELINES = ("ddp", "deepspeed", "zero1")
PEERS = ("ddp", "ddp-powersgd", "deepspeed")
#: its synchronous baselines (default target, in order of preference), also the table's peers:
#: zero1-slowest is what zero1 did under the Trainer before pacing
TRAINER_BASELINES = ("zero1-slowest", "deepspeed", "ddp")

RUN_KEYS = ("mode", "world_size", "bandwidth", "tokens_per_s", "step_time_s", "exposed_comm_s_per_step",
            "bytes_sent_per_rank_per_step", "bytes_received_per_rank_per_step", "link_bytes_per_step",
            "final_train_loss", "val_loss", "peak_rss_mb", "tokens", "steps", "seconds_to_target",
            "tokens_to_target", "step_to_target")


def read_records(path: Path) -> list:
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def ideal_records(path: Path, world: int) -> list:
    """``ideal``'s curve: rank 0's, its tokens scaled to all W trainings (they run at one pace)."""
    return [dict(r, tokens=r["tokens"] * world) if "tokens" in r else r for r in read_records(path)]


def reload_runs(out: Path) -> Tuple[dict, List[dict]]:
    """A finished bench directory's config and runs, each with its per-step records read back
    from its logs and its time to target cleared (``--retarget``)."""
    try:
        payload = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"bench: --retarget {out}: no readable results.json there ({err}); pass the "
                         f"--out directory of a finished bench run") from None
    runs = payload["runs"]
    for r in runs:
        labels = [f"{r['mode']}.{r['steps']}.{rep}" for rep in range(r["repeats"])]
        if r["mode"] == "ideal":
            recs = [ideal_records(out / "logs" / f"{label}.rank0.jsonl", r["world_size"]) for label in labels]
        else:
            recs = [read_records(out / "logs" / f"{label}.jsonl") for label in labels]
        if not all(recs):
            raise SystemExit(f"bench: --retarget {out}: the per-step log of {r['mode']} at {r['steps']} "
                             f"steps is missing or empty in {out / 'logs'}; retarget the directory the "
                             f"bench wrote, with its logs")
        r.update(all_records=recs, records=recs[len(recs) // 2], seconds_to_target=None,
                 tokens_to_target=None, step_to_target=None)
    return payload["config"], runs


def time_to_target(records: List[dict], target: float) -> Optional[dict]:
    """When the validation loss reached ``target`` (None if it never did): seconds and tokens
    interpolated linearly in the loss between the last validation above the target and the first
    at or below it (that one's own values if it is the first validation), and the step of that
    first validation. ``train_s`` is the training clock, validation excluded (train.py's records)."""
    prev = None
    for r in records:
        if "val_loss" not in r:
            continue
        if r["val_loss"] <= target:
            if prev is None:
                return {"seconds": r["train_s"], "tokens": r["tokens"], "step": r["step"]}
            f = (prev["val_loss"] - target) / (prev["val_loss"] - r["val_loss"])
            return {"seconds": prev["train_s"] + f * (r["train_s"] - prev["train_s"]),
                    "tokens": int(round(prev["tokens"] + f * (r["tokens"] - prev["tokens"]))),
                    "step": r["step"]}
        prev = r
    return None


def summarize(mode: str, runs: List[dict], bandwidth: Optional[str], steps: int) -> dict:
    """Medians over repeats, in the results.json schema (time to target filled in later)."""
    def med(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    link = med("link_bytes_per_rank_per_step")
    return {"mode": mode, "world_size": runs[0]["world_size"], "bandwidth": bandwidth,
            "tokens_per_s": med("tokens_per_s"), "step_time_s": med("step_time_s"),
            "exposed_comm_s_per_step": med("exposed_comm_s_per_step"),
            "bytes_sent_per_rank_per_step": med("bytes_sent_per_rank_per_step"),
            "bytes_received_per_rank_per_step": med("bytes_received_per_rank_per_step"),
            "link_bytes_per_step": link,
            "final_train_loss": med("final_train_loss"), "val_loss": med("val_loss"),
            "peak_rss_mb": med("peak_rss_mb"), "tokens": int(med("tokens")), "steps": steps,
            "repeats": len(runs), "micro_batches_per_round": med("micro_batches_per_round"),
            # lowcomm.pace: each rank's share of its micro-batches computed fully (recent steps)
            "computed_share_by_rank": _median_lists([r.get("computed_share_by_rank") for r in runs]),
            "seconds_to_target": None, "tokens_to_target": None, "step_to_target": None,
            "all_records": [r["records"] for r in runs], "records": runs[len(runs) // 2]["records"]}


def _median_lists(lists: List[Optional[list]]) -> Optional[list]:
    lists = [l for l in lists if l]
    return [statistics.median(v) for v in zip(*lists)] if lists else None


#: relative margin above the baseline's final val loss in the default target: the exact modes end
#: on that loss up to float rounding (another reduction order: 3.0435468 against DDP's 3.0435467)
TARGET_TOLERANCE = 1e-4


def default_target(runs: List[dict], budget: Optional[int] = None,
                   baselines: Tuple[str, ...] = BASELINES) -> Optional[tuple]:
    """(target, what it is): the final val loss of the first synchronous baseline run (of
    ``baselines``), at ``budget`` (default its longest), times 1 + ``TARGET_TOLERANCE``."""
    for name in baselines:
        mine = [r for r in runs if r["mode"] == name]
        if mine:
            if budget is None:
                best = max(mine, key=lambda r: r["steps"])
            else:
                best = next((r for r in mine if r["steps"] == budget), None)
                if best is None:
                    raise SystemExit(f"bench: --target-budget {budget}: {name} ran at "
                                     f"{sorted(r['steps'] for r in mine)} steps only; pick one of those")
            return (best["val_loss"] * (1 + TARGET_TOLERANCE),
                    f"{name}'s final val loss at {best['steps']} steps + {TARGET_TOLERANCE:g}")
    return None


def apply_target(runs: List[dict], target: float) -> None:
    """Seconds, tokens and step to ``target`` for every run: the median over its repeats when
    every repeat got there (else None). Not for ``ideal``: its W trainings are each on 1/W of
    the batch, not the same training, so only its pace means something."""
    for r in runs:
        if r["mode"] == "ideal":
            continue
        hits = [time_to_target(recs, target) for recs in r["all_records"]]
        if hits and all(h is not None for h in hits):
            r["seconds_to_target"] = statistics.median(h["seconds"] for h in hits)
            r["tokens_to_target"] = int(statistics.median(h["tokens"] for h in hits))
            r["step_to_target"] = int(statistics.median(h["step"] for h in hits))


def best_per_mode(runs: List[dict]) -> List[dict]:
    """Each mode at the budget that reached the target soonest (or its longest budget if none did)."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        reached = [r for r in mine if r["seconds_to_target"] is not None]
        out.append(min(reached, key=lambda r: r["seconds_to_target"]) if reached
                   else max(mine, key=lambda r: r["steps"]))
    return out
