"""The ``"lowcomm"`` section of a DeepSpeed JSON, and the DeepSpeed settings it can live with.

DeepSpeed 0.19.8 accepts unknown top-level keys silently but forbids unknown keys inside its own
sections (``zero_optimization``, ``bf16``... are pydantic models with ``extra="forbid"``), so every
knob of ours lives in one top-level object::

    "lowcomm": {"mode": "zero1", "comm_dtype": "auto", "shard_group_size": null,
                "collective_timeout_s": 300, "zero1": {}}

Each mode may add a sub-object named after it (``"acco": {...}``); its schema is the mode's
``Options`` dataclass (see ``ds_lowcomm.modes``). Everything is validated before any engine is
built: a bad value raises :class:`LowCommConfigError` with one line naming the key, the value and
what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

SECTION = "lowcomm"
#: ``"mode": "automatic"``: not a mode but a chooser of one (:mod:`ds_lowcomm.auto`)
AUTO = "automatic"
COMM_DTYPES = ("auto", "fp32", "bf16")
PACES = ("fastest", "slowest")
#: the spellings DeepSpeed accepts for ``data_types.grad_accum_dtype``, by the dtype they name
GRAD_ACCUM_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                     "fp16": "fp16", "float16": "fp16"}


class LowCommConfigError(ValueError):
    """A configuration ds_lowcomm cannot run; the message names the key and the fix."""


def option(default: Any, doc: str, *, choices: tuple = (), minimum: Optional[float] = None,
           exclusive_minimum: bool = False, below: Optional[float] = None) -> Any:
    """A dataclass field that :func:`parse_options` validates: ``choices``, a lower bound, and/or
    a strict upper bound ``below``."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "minimum": minimum,
                                            "exclusive_minimum": exclusive_minimum, "below": below})


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(_type_name(a) for a in args) + " or null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _check_value(key: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    optional = type(None) in typing.get_args(tp)
    base = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
    if value is None:
        if optional:
            return None
        raise LowCommConfigError(f"{key}: got null; expected {_type_name(tp)}")
    ok = (isinstance(value, bool) if base is bool else
          isinstance(value, int) and not isinstance(value, bool) if base is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if base is float else
          isinstance(value, base))
    if not ok:
        raise LowCommConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise LowCommConfigError(f"{key}: got {value!r}; allowed: {allowed}")
    lo = meta.get("minimum")
    if lo is not None and (value <= lo if meta.get("exclusive_minimum") else value < lo):
        bound = f"> {lo}" if meta.get("exclusive_minimum") else f">= {lo}"
        raise LowCommConfigError(f"{key}: got {value!r}; must be {bound}")
    hi = meta.get("below")
    if hi is not None and value >= hi:
        raise LowCommConfigError(f"{key}: got {value!r}; must be < {hi}")
    return float(value) if base is float else value


def reject_unknown_keys(path: str, raw: Mapping[str, Any], allowed: typing.Iterable[str]) -> None:
    """Raise for the first key of ``raw`` not in ``allowed``, with a "did you mean" hint."""
    allowed = list(allowed)
    for key in raw:
        if key not in allowed:
            hint = difflib.get_close_matches(str(key), allowed, n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise LowCommConfigError(f"{path}.{key}: unknown key{did_you_mean}; "
                                     f"allowed keys: {', '.join(allowed) or 'none'}")


def parse_options(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a JSON object, validating every key against its fields."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise LowCommConfigError(f"{path}: got {raw!r}; expected a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown_keys(path, raw, fields)
    hints = typing.get_type_hints(cls)
    values = {name: _check_value(f"{path}.{name}", raw[name], hints[name], fields[name].metadata)
              for name in raw}
    return cls(**values)


@dataclass(frozen=True)
class AutoOptions:
    """``"lowcomm": {"automatic": {...}}``: options of ``"mode": "automatic"``."""
    recheck_every: int = option(200, "optimizer steps between re-checks of the choice with the compute per step "
                                "measured since (the first micro-batch's includes warm-up); a different "
                                "verdict is logged, the mode is not switched in flight; 0 = never",
                                minimum=0)


@dataclass(frozen=True)
class LowCommConfig:
    """The validated ``"lowcomm"`` section; ``mode_options`` is the selected mode's ``Options``."""

    mode: str = option("zero1", "which algorithm owns data-parallel communication")
    comm_dtype: str = option("auto", "dtype gradients are reduced in; 'auto' follows DeepSpeed's "
                             "communication_data_type, else the model dtype", choices=COMM_DTYPES)
    shard_group_size: Optional[int] = option(None, "ranks sharing one copy of the optimizer state "
                                             "(a node); null = the whole world", minimum=1)
    collective_timeout_s: float = option(300.0, "seconds a collective may wait for a peer before the "
                                         "run aborts", minimum=0, exclusive_minimum=True)
    async_save: bool = option(False, "save_checkpoint returns once this rank's state is copied; the "
                              "file is written, hashed and made durable on a background thread and "
                              "'latest' moves when every rank's file is complete")
    save_on_preemption: bool = option(True, "on SIGTERM or SIGUSR1 (a preemption notice, torchrun stopping "
                                      "its workers, SLURM's warning) the Hugging Face Trainer and "
                                      "examples/train.py finish the step, save a checkpoint and exit with "
                                      "128 + the signal's number, which restart policies restart; false: "
                                      "the signal ends the process as usual")
    max_consecutive_skips: int = option(10, "consecutive steps skipped for a non-finite gradient "
                                        "(not counting fp16 overflows that lower the loss scale) "
                                        "after which the run stops as diverged", minimum=1)
    pace: Optional[str] = option(None, "'fastest': a rank slower than the fastest runs some of the loop's "
                                 "micro-batches forward only, so the fastest rank sets the pace (the default "
                                 "where the mode supports it and the loop marks its own accumulation "
                                 "boundaries: the Trainer, accelerate, TRL); 'slowest': every rank "
                                 "computes every micro-batch", choices=PACES)
    mode_options: Any = None
    #: every mode's validated sub-object, by name, and the keys its JSON object gave (``"mode":
    #: "automatic"`` builds the chosen mode from them, the user's keys over its own picks)
    options_by_mode: Any = field(default=None, compare=False, repr=False)
    given_by_mode: Any = field(default=None, compare=False, repr=False)
    #: ``"mode": "automatic"``: ``check(mode, options, shard_group_size)``, the reason that mode cannot run
    #: with those settings under this DeepSpeed config (its ``check_config``), or None
    check_mode: Any = field(default=None, compare=False, repr=False)

    @staticmethod
    def from_dict(raw: Any, modes: Mapping[str, Any]) -> "LowCommConfig":
        """Validate the raw ``"lowcomm"`` object against ``modes`` (the registry, name -> mode
        class, :data:`ds_lowcomm.modes.MODES`). Raises :class:`LowCommConfigError`."""
        if not isinstance(raw, Mapping):
            raise LowCommConfigError(f"{SECTION}: got {raw!r}; expected a JSON object such as "
                                     f'{{"mode": "zero1"}}')
        if "mode" not in raw:
            raise LowCommConfigError(f"{SECTION}.mode: missing; set it to one of: {', '.join([*modes, AUTO])}")
        mode = raw["mode"]
        if mode not in modes and mode != AUTO:
            hint = difflib.get_close_matches(str(mode), [*modes, AUTO], n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise LowCommConfigError(f"{SECTION}.mode: got {mode!r}{did_you_mean}; "
                                     f"allowed: {', '.join([*modes, AUTO])}")
        fields = {f.name: f for f in dataclasses.fields(LowCommConfig)
                  if f.name not in ("mode_options", "options_by_mode", "given_by_mode", "check_mode")}
        reject_unknown_keys(SECTION, raw, list(fields) + list(modes) + [AUTO])
        hints = typing.get_type_hints(LowCommConfig)
        general = {k: _check_value(f"{SECTION}.{k}", v, hints[k], fields[k].metadata)
                   for k, v in raw.items() if k in fields}
        # Every mode's sub-object is validated, not only the selected one's, so switching "mode"
        # never reveals a latent typo.
        sub = {name: parse_options(modes[name].Options, raw.get(name), f"{SECTION}.{name}")
               for name in modes}
        sub[AUTO] = parse_options(AutoOptions, raw.get(AUTO), f"{SECTION}.{AUTO}")
        given = {name: frozenset(raw.get(name) or ()) for name in modes}
        return LowCommConfig(mode_options=sub[mode], options_by_mode=sub, given_by_mode=given, **general)


# ------------------------------------------------------------------------------------------------
# DeepSpeed settings that ds_lowcomm replaces or cannot honour.

ADAM_TYPES = ("adam", "adamw", "lowcommadamw")
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "fused", "foreach")


def _real(value: Any) -> Optional[float]:
    """``value`` as a float if it is a real number (or a one-element tensor), else None."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def check_adamw_hyperparameters(params: Mapping[str, Any], where: str) -> None:
    """The checks ``torch.optim.AdamW`` makes at construction, which the shard AdamW (torch's
    kernel called directly) would skip: ``lr``, ``eps``, ``weight_decay`` >= 0, ``betas`` two
    numbers in [0, 1). ``where`` names the place in the message (``optimizer.params``, or a
    client optimizer's ``param_groups[i]``). Raises :class:`LowCommConfigError`."""
    for key in ("lr", "eps", "weight_decay"):
        if key in params and (_real(params[key]) is None or _real(params[key]) < 0):
            raise LowCommConfigError(f"{where}.{key}: got {params[key]!r}; must be a number >= 0")
    if "betas" in params:
        betas = params["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise LowCommConfigError(f"{where}.betas: got {betas!r}; must be two numbers [beta1, beta2], "
                                     f"e.g. [0.9, 0.95]")
        for i, beta in enumerate(betas):
            if _real(beta) is None or not 0.0 <= _real(beta) < 1.0:
                raise LowCommConfigError(f"{where}.betas[{i}]: got {beta!r}; must be a number in [0, 1)")


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def check_deepspeed_config(ds: Mapping[str, Any]) -> None:
    """Reject DeepSpeed settings that conflict with ds_lowcomm owning data-parallel communication.

    Called on the user's JSON before DeepSpeed sees it. Raises :class:`LowCommConfigError`.
    """
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        value = ds.get(key, 1)
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise LowCommConfigError(f"{key}: got {value!r}; must be an integer >= 1")
    fp16 = ds.get("fp16")
    if _enabled(fp16) and fp16.get("fp16_master_weights_and_grads"):
        raise LowCommConfigError("fp16.fp16_master_weights_and_grads: ds_lowcomm keeps fp32 master "
                                 "weights; remove the key")
    autocast = ds.get("torch_autocast")
    dtype = str(autocast.get("dtype")).lower() if _enabled(autocast) else "off"
    if dtype == "none":
        raise LowCommConfigError("torch_autocast.dtype: missing; autocast would take the device's default "
                                 "(float16 on CUDA, with no loss scaling): set \"dtype\": \"bfloat16\"")
    if dtype in ("fp16", "float16", "half", "torch.float16"):  # DeepSpeed's DtypeEnum names (0.19.8)
        # DeepSpeed wraps a stage-0 engine's optimizer step in torch's GradScaler then, whose
        # unscale and inf check bypass the sharded step's own loss scaling and skip rule.
        raise LowCommConfigError("torch_autocast.dtype: float16 autocast is not supported; for fp16 with loss "
                                 "scaling use \"fp16\": {\"enabled\": true}, or set torch_autocast's dtype to "
                                 "\"bfloat16\"")
    timers = ds.get("timers", {})
    throughput = timers.get("throughput", {}) if isinstance(timers, Mapping) else None
    for key, value in (("timers", timers), ("timers.throughput", throughput)):  # outer key first
        # DeepSpeed (0.19.8) ignores a "timers" that is not an object, keeping its throughput
        # timer that synchronizes the device at every forward and step (which ds_lowcomm turns
        # off), and fails on such a "throughput" with a TypeError from its config model.
        if not isinstance(value, Mapping):
            raise LowCommConfigError(f"{key}: got {value!r}; must be a JSON object, e.g. \"timers\": "
                                     "{\"throughput\": {\"enabled\": true}}, or remove it")
    if _enabled(ds.get("amp")):
        raise LowCommConfigError("amp.enabled: apex AMP is not supported; use \"bf16\": {\"enabled\": true}")
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else None
    if stage != 1:
        raise LowCommConfigError(
            f"zero_optimization.stage: got {stage!r}; ds_lowcomm implements ZeRO stage 1 itself, "
            "set \"zero_optimization\": {\"stage\": 1}")
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if isinstance(off, Mapping) and off.get("device", "none") not in (None, "none"):
            raise LowCommConfigError(f"zero_optimization.{key}: offload is not supported; remove it")
    accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    model = ("bf16" if _enabled(ds.get("bf16")) or _enabled(ds.get("bfloat16")) else
             "fp16" if _enabled(fp16) else "fp32")
    if accum is not None and GRAD_ACCUM_DTYPES.get(accum) not in ("fp32", model):
        raise LowCommConfigError(f"data_types.grad_accum_dtype: got {accum!r}; gradients of this {model} model "
                                 f"are summed in \"{model}\" (the default, as in stock DeepSpeed) or \"fp32\"")
    comm = ds.get("communication_data_type")
    if comm not in (None, "fp32", "bf16", "bfp16"):
        raise LowCommConfigError(f"communication_data_type: got {comm!r}; allowed: \"fp32\", \"bf16\"")
    if ds.get("managed_gradient_accumulation", True) is False:
        raise LowCommConfigError("managed_gradient_accumulation: false is not supported; remove it")
    op = ds.get("gradient_allreduce_op", "mean")
    if str(op).lower() != "mean":
        raise LowCommConfigError(f"gradient_allreduce_op: got {op!r}; ds_lowcomm averages gradients over "
                                 "ranks (\"mean\", DeepSpeed's default): remove the key")
    if _enabled(ds.get("hybrid_engine")):
        raise LowCommConfigError("hybrid_engine.enabled: DeepSpeed's hybrid (RLHF) engine is not "
                                 "supported; remove it or the \"lowcomm\" section")
    tp = ds.get("tensor_parallel")
    if isinstance(tp, Mapping) and int(tp.get("autotp_size", 0) or 0) > 1:
        raise LowCommConfigError("tensor_parallel.autotp_size: tensor parallelism is not supported")
    opt = ds.get("optimizer")
    if opt is not None:
        if not isinstance(opt, Mapping) or str(opt.get("type", "")).lower() not in ADAM_TYPES:
            got = opt.get("type") if isinstance(opt, Mapping) else opt
            raise LowCommConfigError(f"optimizer.type: got {got!r}; ds_lowcomm runs AdamW on the shard, "
                                     "use \"AdamW\" (or \"LowCommAdamW\")")
        params = opt.get("params") or {}
        reject_unknown_keys("optimizer.params", params, OPTIMIZER_PARAMS)
        if params.get("adam_w_mode", True) is False:
            raise LowCommConfigError("optimizer.params.adam_w_mode: false (L2-coupled Adam) is not "
                                     "supported; ds_lowcomm uses decoupled weight decay (AdamW)")
        check_adamw_hyperparameters(params, "optimizer.params")


def check_section_name(ds: Mapping[str, Any]) -> None:
    """A DeepSpeed config without a ``"lowcomm"`` section trains stock DeepSpeed: raise for a
    top-level key that looks like a misspelt one (``"lowcom"``, ``"low_comm"``, ``"LowComm"``),
    which DeepSpeed would ignore without a word."""
    if SECTION in ds:
        return
    squash = lambda key: "".join(c for c in str(key).lower() if c.isalnum())  # noqa: E731
    for key in ds:
        if squash(key) != SECTION and difflib.SequenceMatcher(None, squash(key), SECTION).ratio() < 0.8:
            continue
        raise LowCommConfigError(f"{key}: not a DeepSpeed key, and this config has no {SECTION!r} section, "
                                 f"so it would train stock DeepSpeed; did you mean {SECTION!r}? Rename the "
                                 f"key (or remove it)")


def parse(ds: Mapping[str, Any], modes: Mapping[str, Any]) -> LowCommConfig:
    """Validate a whole DeepSpeed config dict that has a ``"lowcomm"`` section, given the mode
    registry ``modes`` (handed in, not imported: the modes import this module)."""
    cfg = LowCommConfig.from_dict(ds[SECTION], modes)
    check_deepspeed_config(ds)
    if cfg.mode == AUTO:  # the chooser checks each candidate with its own settings
        def check(mode: str, options: Any, shard_group_size: Optional[int]) -> Optional[str]:
            if cfg.pace == "fastest" and not modes[mode].paces:
                return "lowcomm.pace is 'fastest'"
            trial = dataclasses.replace(cfg, mode=mode, mode_options=options, shard_group_size=shard_group_size)
            try:
                modes[mode].check_config(ds, trial)
            except LowCommConfigError as err:
                return str(err)
            return None
        return dataclasses.replace(cfg, check_mode=check)
    if cfg.pace == "fastest" and not modes[cfg.mode].paces:
        raise LowCommConfigError(
            f"{SECTION}.pace: 'fastest' is not available in mode {cfg.mode!r}: its replicas step on their "
            f"own gradients and exchange nothing on most steps, so no rank learns the others' pace; "
            f"remove the key (or use mode 'zero1' or 'acco')")
    modes[cfg.mode].check_config(ds, cfg)
    return cfg


# ------------------------------------------------------------------------------------------------
# The reference page (docs/configuration.md), generated from the schema above.

def _range(meta: Mapping[str, Any]) -> str:
    parts = []
    if meta.get("choices"):
        parts.append(", ".join(f"`{json_value(c)}`" for c in meta["choices"]))
    if meta.get("minimum") is not None:
        parts.append(f"{'>' if meta.get('exclusive_minimum') else '>='} {meta['minimum']:g}")
    if meta.get("below") is not None:
        parts.append(f"< {meta['below']:g}")
    return "; ".join(parts) or "any"


def json_value(value: Any) -> str:
    """``value`` as it is written in the JSON file (``300`` for 300.0)."""
    return f"{value:g}" if isinstance(value, float) else json.dumps(value)


def _rows(cls: type, prefix: str, skip: tuple = ()) -> list:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        doc = f.metadata["doc"].replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | {_type_name(hints[f.name])} | `{json_value(f.default)}` | "
                    f"{_range(f.metadata)} | {doc} |")
    return rows


def reference_markdown(modes: Mapping[str, Any]) -> str:
    """The configuration reference: every key of the ``"lowcomm"`` section and of each mode's
    sub-object (``modes``: the registry), with its type, default, allowed range and meaning, as
    :meth:`LowCommConfig.from_dict` validates them. ``tools/config_reference.py`` writes it to
    ``docs/configuration.md``; a test fails when the page and this differ."""
    head = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    out = ["# Configuration reference", "",
           "<!-- generated by tools/config_reference.py from ds_lowcomm/config.py and each mode's Options; "
           "do not edit by hand -->", "",
           f"Everything of ds_lowcomm's is in one top-level object of the DeepSpeed JSON, `\"{SECTION}\"`. "
           "DeepSpeed ignores unknown top-level keys and rejects unknown keys inside its own sections, so "
           "nothing of ours lives there. Every key below is checked before anything starts; a bad one "
           "stops `deepspeed.initialize` with one line naming the key, the value and what is allowed "
           "(an unknown key gets a \"did you mean\").", "",
           "```json", f'"{SECTION}": {{"mode": "zero1", "comm_dtype": "auto", "zero1": {{"overlap": true}}}}', "```",
           "", f"## `{SECTION}`", "",
           *head, f"| `mode` | a string | required | {', '.join(f'`{json_value(m)}`' for m in [*modes, AUTO])} | "
           "which algorithm owns data-parallel communication (`\"automatic\"`: chosen from the measured compute "
           "and links, see docs/automatic.md) |",
           *_rows(LowCommConfig, "", skip=("mode", "mode_options", "options_by_mode", "given_by_mode",
                                            "check_mode"))]
    for name, cls in modes.items():
        out += ["", f"## `{SECTION}.{name}` (mode `{name}`)", ""]
        rows = _rows(cls.Options, f"{name}.")
        out += [*head, *rows] if rows else ["No options."]
    out += ["", f"## `{SECTION}.{AUTO}` (mode `{AUTO}`)", "", *head, *_rows(AutoOptions, f"{AUTO}.")]
    out += ["", "Every mode's sub-object is validated whichever mode is selected, so switching `mode` never "
            "reveals a latent typo.", "",
            "## DeepSpeed keys", "",
            "DeepSpeed's own keys keep their meaning (`train_micro_batch_size_per_gpu`, "
            "`gradient_accumulation_steps`, `gradient_clipping`, `fp16`, `bf16`, `data_types.grad_accum_dtype`, "
            "`optimizer`, `scheduler`, `steps_per_print`). `zero_optimization.stage` must be 1. Refused, each "
            "with its one line: ZeRO stages 0, 2 and 3, offload, `amp`, `fp16.fp16_master_weights_and_grads`, "
            "a `grad_accum_dtype` other than the model's or fp32, pipeline parallelism, MoE, AutoTP, the hybrid "
            "engine, optimizers other than Adam/AdamW (`\"LowCommAdamW\"` is AdamW that stock DeepSpeed refuses "
            "to run), `gradient_allreduce_op` other than `\"mean\"`, and AdamW values outside "
            "`torch.optim.AdamW`'s ranges."]
    return "\n".join(out) + "\n"
