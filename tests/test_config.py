"""Bad configurations fail before training with one line naming the key."""
import copy
import json
from pathlib import Path

import pytest

from ds_lowcomm.config import LowCommConfig, LowCommConfigError
from ds_lowcomm.config import parse as parse_with
from ds_lowcomm.modes import MODES
import workers
from workers import config

GOOD = config("zero1")


def parse(ds):
    return parse_with(ds, MODES)


def variant(edit):
    cfg = copy.deepcopy(GOOD)
    edit(cfg)
    return cfg


def _set(path, value):
    def edit(cfg):
        *head, last = path
        node = cfg
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return edit


def _del(*path):
    def edit(cfg):
        node = cfg
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return edit


BAD = [
    # (edit, key the message must name, words it must contain)
    (_set(("lowcomm", "mode"), "acc0"), "lowcomm.mode", "allowed"),
    (_set(("lowcomm",), {"comm_dtype": "fp32"}), "lowcomm.mode", "missing"),
    (_set(("lowcomm",), "zero1"), "lowcomm", "JSON object"),
    (_set(("lowcomm", "comm_dtpye"), "bf16"), "lowcomm.comm_dtpye", "did you mean 'comm_dtype'"),
    (_set(("lowcomm", "comm_dtype"), "fp8"), "lowcomm.comm_dtype", "allowed"),
    (_set(("lowcomm", "comm_dtype"), "fp16"), "lowcomm.comm_dtype", "allowed"),
    (_set(("lowcomm", "shard_group_size"), -2), "lowcomm.shard_group_size", ">= 1"),
    (_set(("lowcomm", "shard_group_size"), 0), "lowcomm.shard_group_size", ">= 1"),
    (_set(("lowcomm", "shard_group_size"), "2"), "lowcomm.shard_group_size", "integer"),
    (_set(("lowcomm", "shard_group_size"), 1.5), "lowcomm.shard_group_size", "integer"),
    (_set(("lowcomm", "collective_timeout_s"), 0), "lowcomm.collective_timeout_s", "> 0"),
    (_set(("lowcomm", "collective_timeout_s"), True), "lowcomm.collective_timeout_s", "number"),
    (_set(("lowcomm", "zero1"), {"bucket": 1}), "lowcomm.zero1.bucket", "unknown key"),
    (_set(("lowcomm", "zero1"), [1]), "lowcomm.zero1", "JSON object"),
    (_set(("lowcomm", "zerro1"), {}), "lowcomm.zerro1", "did you mean 'zero1'"),
    (_set(("lowcomm", "acco"), {"variant": "wp"}), "lowcomm.acco.variant", "allowed: 'acco', 'dpu'"),
    (_set(("lowcomm", "acco"), {"accumulate_while_waitng": True}), "lowcomm.acco.accumulate_while_waitng",
     "did you mean 'accumulate_while_waiting'"),
    (_set(("lowcomm", "acco"), {"accumulate_while_waiting": 1}), "lowcomm.acco.accumulate_while_waiting", "boolean"),
    (lambda c: c["lowcomm"].update(mode="acco", acco={"balance": True, "accumulate_while_waiting": False}),
     "lowcomm.acco.balance", "set accumulate_while_waiting to true"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, pace="fastest"), "lowcomm.pace",
     "not available in mode 'desloc'"),
    (_set(("lowcomm", "pace"), "fast"), "lowcomm.pace", "allowed"),
    (lambda c: c["lowcomm"].update(mode="acco", acco={"variant": "dpu", "estimate_dtype": "bf16"}),
     "lowcomm.acco.estimate_dtype", "leave estimate_dtype out"),
    (lambda c: c["lowcomm"].update(mode="acco", acco={"estimate_dtype": "fp16"}),
     "lowcomm.acco.estimate_dtype", "bf16"),
    (lambda c: (c["lowcomm"].update(mode="acco"), c.update(gradient_accumulation_steps=3)),
     "gradient_accumulation_steps", "even number"),
    (lambda c: c["lowcomm"].update(mode="demo"), "lowcomm.shard_group_size", "ranks per node"),
    (lambda c: c["lowcomm"].update(mode="demo", shard_group_size=1, demo={"beta": 1.0}), "lowcomm.demo.beta", "< 1"),
    (lambda c: c["lowcomm"].update(mode="demo", shard_group_size=1, demo={"chunk": 8, "topk": 65}),
     "lowcomm.demo.topk", "chunk² = 64"),
    (_set(("lowcomm", "demo"), {"values": "fp8"}), "lowcomm.demo.values", "allowed: 'bf16', 'sign'"),
    (lambda c: c["lowcomm"].update(mode="demo", shard_group_size=2, demo={"overlap": True}),
     "lowcomm.demo.lookahead", "set demo.lookahead to false"),
    (lambda c: c["lowcomm"].update(mode="desloc"), "lowcomm.shard_group_size", "ranks per node"),
    (_set(("lowcomm", "desloc"), {"param_sync_every": 0}), "lowcomm.desloc.param_sync_every", ">= 1"),
    (_set(("lowcomm", "desloc"), {"momentum_sync_every": -3}), "lowcomm.desloc.momentum_sync_every", ">= 0"),
    (_set(("lowcomm", "desloc"), {"variance_sync_every": "never"}), "lowcomm.desloc.variance_sync_every",
     "integer or null"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"sync_values": "int8"}),
     "lowcomm.desloc.sync_values", "set lowcomm.desloc.sync_topk"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"sync_topk": 65, "sync_chunk": 64}),
     "lowcomm.desloc.sync_topk", "at most sync_chunk (64)"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"sync_topk": 1, "sync_chunk": 1 << 16}),
     "lowcomm.desloc.sync_chunk", "at most 32768"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1,
                                   desloc={"sync_topk": 4, "sync_chunk": 128, "sync_values": "int2"}),
     "lowcomm.desloc.sync_chunk", "at most 64"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"sync_topk": 4, "sync_values": "int4"}),
     "lowcomm.desloc.sync_values", "int2"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={
        "moment_sync_topk": 4, "sync_values": "int2"}),
     "lowcomm.desloc.sync_values", "the compressed moment syncs' values are moment_sync_values"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"sync_chunk": 32}),
     "lowcomm.desloc.sync_chunk", "set lowcomm.desloc.sync_topk or moment_sync_topk"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"moment_sync_topk": 65}),
     "lowcomm.desloc.moment_sync_topk", "at most sync_chunk (64)"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"moment_sync_values": "int8"}),
     "lowcomm.desloc.moment_sync_values", "set lowcomm.desloc.moment_sync_topk"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={
        "sync_topk": 1, "moment_sync_values": "int8"}),
     "lowcomm.desloc.moment_sync_values", "set lowcomm.desloc.moment_sync_topk"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={
        "moment_sync_topk": 4, "sync_chunk": 128, "moment_sync_values": "int2"}),
     "lowcomm.desloc.sync_chunk", "or moment_sync_values to 'int8' or 'bf16'"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={
        "moment_sync_topk": 2, "momentum_sync_every": 0, "variance_sync_every": 0}),
     "lowcomm.desloc.moment_sync_topk", "set one of them, or leave moment_sync_topk out"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={
        "moment_sync_topk": 2, "param_sync_delay": 2}),
     "lowcomm.desloc.moment_sync_topk", "set param_sync_delay to 0"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"param_sync_every": 4,
                                                                                "param_sync_delay": 4}),
     "lowcomm.desloc.param_sync_delay", "at most param_sync_every - 1 (3)"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"inner_optimizer": "lion"}),
     "lowcomm.desloc.inner_optimizer", "muon"),
    (lambda c: c["lowcomm"].update(mode="desloc", shard_group_size=1, desloc={"outer_momentum": 1.0}),
     "lowcomm.desloc.outer_momentum", "< 1"),
    (_set(("fp16",), {"enabled": True, "fp16_master_weights_and_grads": True}),
     "fp16.fp16_master_weights_and_grads", "fp32 master"),
    (_set(("lowcomm", "max_consecutive_skips"), 0), "lowcomm.max_consecutive_skips", ">= 1"),
    (_set(("lowcomm", "max_consecutive_skips"), 2.5), "lowcomm.max_consecutive_skips", "integer"),
    (_set(("zero_optimization", "stage"), 2), "zero_optimization.stage", "got 2"),
    (_set(("zero_optimization", "stage"), 3), "zero_optimization.stage", "got 3"),
    (_del("zero_optimization"), "zero_optimization.stage", "stage\": 1"),
    (_set(("zero_optimization", "offload_optimizer"), {"device": "cpu"}), "zero_optimization.offload_optimizer", "offload"),
    (_set(("zero_optimization", "offload_param"), {"device": "nvme"}), "zero_optimization.offload_param", "offload"),
    (_set(("optimizer", "type"), "SGD"), "optimizer.type", "AdamW"),
    (_set(("optimizer", "params", "momentum"), 0.9), "optimizer.params.momentum", "unknown key"),
    (_set(("optimizer", "params", "adam_w_mode"), False), "optimizer.params.adam_w_mode", "decoupled"),
    (_set(("optimizer", "params", "lr"), -1.0), "optimizer.params.lr", ">= 0"),
    (_set(("optimizer", "params", "lr"), "1e-3"), "optimizer.params.lr", ">= 0"),
    (_set(("optimizer", "params", "betas"), [0.9, 1.5]), "optimizer.params.betas[1]", "in [0, 1)"),
    (_set(("optimizer", "params", "betas"), [-0.1, 0.95]), "optimizer.params.betas[0]", "in [0, 1)"),
    (_set(("optimizer", "params", "betas"), [0.9]), "optimizer.params.betas", "two numbers"),
    (_set(("optimizer", "params", "betas"), "0.9,0.95"), "optimizer.params.betas", "two numbers"),
    (_set(("optimizer", "params", "eps"), -1), "optimizer.params.eps", ">= 0"),
    (_set(("optimizer", "params", "eps"), float("nan")), "optimizer.params.eps", ">= 0"),
    (_set(("optimizer", "params", "weight_decay"), "0.1"), "optimizer.params.weight_decay", ">= 0"),
    (_set(("optimizer", "params", "weight_decay"), -0.1), "optimizer.params.weight_decay", ">= 0"),
    (_set(("data_types",), {"grad_accum_dtype": "bf16"}), "data_types.grad_accum_dtype", "fp32 model"),
    (lambda c: c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp16"}),
     "data_types.grad_accum_dtype", "\"bf16\" (the default, as in stock DeepSpeed) or \"fp32\""),
    (_set(("data_types",), {"grad_accum_dtype": "fp64"}), "data_types.grad_accum_dtype", "got 'fp64'"),
    (_set(("communication_data_type",), "fp16"), "communication_data_type", "allowed"),
    (_set(("amp",), {"enabled": True}), "amp.enabled", "bf16"),
    (_set(("torch_autocast",), {"enabled": True, "dtype": "float16"}), "torch_autocast.dtype", "\"fp16\": {"),
    (_set(("torch_autocast",), {"enabled": True, "dtype": "torch.float16"}), "torch_autocast.dtype", "\"fp16\": {"),
    (_set(("torch_autocast",), {"enabled": True}), "torch_autocast.dtype", "\"dtype\": \"bfloat16\""),
    (_set(("timers",), []), "timers", "must be a JSON object"),
    (_set(("timers",), {"throughput": True}), "timers.throughput", "\"enabled\": true"),
    (_set(("managed_gradient_accumulation",), False), "managed_gradient_accumulation", "not supported"),
    (_set(("tensor_parallel",), {"autotp_size": 2}), "tensor_parallel.autotp_size", "not supported"),
    (_set(("hybrid_engine",), {"enabled": True}), "hybrid_engine.enabled", "not supported"),
    (_set(("gradient_accumulation_steps",), 0), "gradient_accumulation_steps", "integer >= 1"),
    (_set(("gradient_allreduce_op",), "sum"), "gradient_allreduce_op", "remove the key"),
    (_set(("train_micro_batch_size_per_gpu",), 2.5), "train_micro_batch_size_per_gpu", "integer >= 1"),
    (_set(("train_batch_size",), "16"), "train_batch_size", "integer >= 1"),
]


@pytest.mark.unit
@pytest.mark.parametrize("edit,key,words", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_config_names_the_key(edit, key, words):
    with pytest.raises(LowCommConfigError) as info:
        parse(variant(edit))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(key + ":") or msg.startswith(key + " "), msg
    assert words in msg, msg


@pytest.mark.unit
def test_good_config_defaults():
    cfg = parse(GOOD)
    assert cfg == LowCommConfig(mode="zero1", comm_dtype="auto", shard_group_size=None,
                                collective_timeout_s=300.0, mode_options=MODES["zero1"].Options())
    assert cfg.mode_options.overlap is False  # the documented default, not the dataclass compared with itself
    assert parse(variant(_set(("lowcomm", "collective_timeout_s"), 5))).collective_timeout_s == 5.0
    assert parse(variant(_set(("lowcomm", "comm_dtype"), "bf16"))).comm_dtype == "bf16"
    # DeepSpeed's spellings of the gradient sums' dtype: the model's or fp32.
    for model, accum in (({}, "fp32"), ({"bf16": {"enabled": True}}, "bfloat16"),
                         ({"bf16": {"enabled": True}}, "fp32"), ({"fp16": {"enabled": True}}, "fp16")):
        parse(variant(lambda c: c.update(model, data_types={"grad_accum_dtype": accum})))


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["zero1", "acco", "demo", "desloc", "automatic"])
def test_trainer_configs_match_the_deepspeed_ones(mode):
    """ds_configs/hf/<mode>.json: the shipped mode's "lowcomm" section, and only "auto" where a
    script's arguments decide."""
    root = Path(__file__).resolve().parents[1] / "ds_configs"
    hf = json.loads((root / "hf" / f"{mode}.json").read_text())
    plain = json.loads((root / ({"zero1": "zero1.json", "automatic": "automatic.json"}.get(mode, f"{mode}_zero1.json"))).read_text())
    assert hf["lowcomm"] == plain["lowcomm"]
    assert "optimizer" not in hf and "scheduler" not in hf
    autos = {k for k, v in hf.items() if v == "auto"}
    assert autos == {"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                     "gradient_clipping"} and hf["bf16"] == {"enabled": "auto"}
    filled = {**hf, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 8, "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0, "bf16": {"enabled": False}}  # as the Trainer fills them
    assert parse(filled).mode == mode


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json")
                                        if p.name != "deepspeed_zero1.json"))
def test_shipped_configs_are_valid(name):
    """Every shipped ds_lowcomm config passes the checks a run makes before it starts."""
    cfg = json.loads((Path(__file__).resolve().parents[1] / "ds_configs" / name).read_text())
    assert parse(cfg).mode == cfg["lowcomm"]["mode"]


@pytest.mark.integration
def test_initialize_rejects_before_touching_distributed():
    """A bad config raises from deepspeed.initialize itself, before any process group exists."""
    import deepspeed
    import torch

    import ds_lowcomm  # noqa: F401
    from workers import tiny_gpt2

    with pytest.raises(LowCommConfigError, match=r"^lowcomm\.max_consecutive_skips"):
        deepspeed.initialize(model=tiny_gpt2(), config=variant(_set(("lowcomm", "max_consecutive_skips"), 0)))
    with pytest.raises(LowCommConfigError, match=r"^optimizer: missing"):
        deepspeed.initialize(model=tiny_gpt2(), config=variant(_del("optimizer")))
    misspelt = copy.deepcopy(GOOD)
    misspelt["lowcom"] = misspelt.pop("lowcomm")  # DeepSpeed alone would ignore it and train stock
    with pytest.raises(LowCommConfigError, match=r"^lowcom: not a DeepSpeed key.*did you mean 'lowcomm'"):
        deepspeed.initialize(model=tiny_gpt2(), config=misspelt)
    assert not torch.distributed.is_initialized()


@pytest.mark.integration
def test_a_config_is_a_path_or_a_shipped_name(tmp_path, monkeypatch):
    """A missing config file is one line naming it (DeepSpeed 0.19.8 alone fails decoding it as
    base64); a shipped config's name works from any directory; a DeepSpeed outside the supported
    series is refused before anything starts."""
    import deepspeed
    import torch

    import ds_lowcomm
    from ds_lowcomm.integration import initialize as init
    from workers import tiny_gpt2

    monkeypatch.chdir(tmp_path)  # no ds_configs/ here
    with pytest.raises(FileNotFoundError, match=r"^DeepSpeed config 'ds_config.json': no such file .* one of: "
                                                r"acco_zero1, .*hf/zero1, zero1"):
        deepspeed.initialize(model=tiny_gpt2(), config="ds_config.json")
    repo = Path(__file__).resolve().parents[1] / "ds_configs"
    for name in ("zero1", "zero1.json", "hf/acco", "ds_configs/demo_slow_link.json"):
        shipped = ds_lowcomm.configs.path(name)
        on_disk = repo / (name.removeprefix("ds_configs/").removesuffix(".json") + ".json")
        assert Path(shipped).resolve() == on_disk.resolve(), name
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(LowCommConfigError, match=r"^DeepSpeed 0.20.1: ds_lowcomm runs on deepspeed>=0.19.8,<0.20"):
        deepspeed.initialize(model=tiny_gpt2(), config="zero1")  # by name, from a directory without it
    assert not torch.distributed.is_initialized()
    init.check_deepspeed_version("0.19.8")
    # setup.py asks pip for the same series
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'"deepspeed{init.DEEPSPEED_VERSIONS}"' in setup


@pytest.mark.parametrize("key", ["lowcom", "low_comm", "LowComm", "low-comm", "lowcomms"])
@pytest.mark.unit
def test_a_misspelt_section_is_refused(key):
    """A near miss of the "lowcomm" section would train stock DeepSpeed, exit 0: refused instead."""
    from ds_lowcomm.config import check_section_name

    with pytest.raises(LowCommConfigError, match=f"^{key}: .*did you mean 'lowcomm'"):
        check_section_name({"train_micro_batch_size_per_gpu": 2, key: {"mode": "zero1"}})
    check_section_name({"train_micro_batch_size_per_gpu": 2, "lowcomm": {}, key: {}})  # a section is there
    check_section_name({"train_micro_batch_size_per_gpu": 2, "communication_data_type": "fp32",
                        "comms_logger": {}, "flops_profiler": {}})  # DeepSpeed's own keys


def _init_error(rank, world, lowcomm):
    try:
        workers.build_engine(config(**lowcomm))
    except LowCommConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("lowcomm,message", [
    ({"mode": "zero1", "shard_group_size": 3}, "lowcomm.shard_group_size: got 3, which does not divide the world size 2"),
    ({"mode": "zero1", "shard_group_size": 1}, "lowcomm.shard_group_size: got 1; mode 'zero1' shards over all 2 ranks"),
], ids=["not-a-divisor", "zero1-replicas"])
@pytest.mark.integration
def test_world_size_errors_on_every_rank(lowcomm, message):
    """Checks that need the world size fail on every rank, before training, instead of hanging."""
    from dist import run_ranks

    for err in run_ranks(_init_error, 2, lowcomm, timeout=120):
        assert err is not None and err.startswith(message), err


def _client_optimizer_error(rank, world):
    import deepspeed
    import torch

    import ds_lowcomm

    ds_lowcomm.skip_shm_comm_build()
    model = workers.tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.param_groups[0]["betas"] = (0.9, 1.5)  # edited after torch checked it
    cfg = config("zero1")
    del cfg["optimizer"]
    try:
        deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    except LowCommConfigError as err:
        return str(err)
    return None


@pytest.mark.integration
def test_client_optimizer_gets_the_same_checks():
    from dist import run_ranks

    (err,) = run_ranks(_client_optimizer_error, 1, timeout=120)
    assert err == "the client optimizer's param_groups[0].betas[1]: got 1.5; must be a number in [0, 1)", err


def _clipping(rank, world):
    cfg = config("zero1")
    del cfg["gradient_clipping"]
    return workers.build_engine(cfg).optimizer.gradient_clipping


@pytest.mark.integration
def test_gradient_clipping_follows_deepspeeds_default():
    """A JSON without "gradient_clipping" clips as stock DeepSpeed would (its default is 1.0
    since 0.19.3, no longer 0)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from dist import run_ranks

    (clip,) = run_ranks(_clipping, 1, timeout=120)
    assert clip == GRADIENT_CLIPPING_DEFAULT


@pytest.mark.unit
@pytest.mark.parametrize("timers, synchronized, warns", [
    (None, False, False),
    ({"throughput": {"enabled": True}}, False, False),
    ({"throughput": {"synchronized": True}}, True, True),
    ({"throughput": {"synchronized": True, "enabled": False}}, True, False),
])
def test_deepspeeds_throughput_timer_never_synchronizes_unasked(caplog, timers, synchronized, warns):
    """The config DeepSpeed's engine gets says ``timers.throughput.synchronized`` false unless the
    user's says true, which is kept with a warning naming the cost (tests/test_host_syncs.py counts
    the synchronizes in real steps)."""
    import logging

    from ds_lowcomm.integration.initialize import _unsynchronized_throughput_timer

    ds = {} if timers is None else {"timers": copy.deepcopy(timers)}
    with caplog.at_level(logging.WARNING, logger="ds_lowcomm"):
        _unsynchronized_throughput_timer(ds)
    assert ds["timers"]["throughput"]["synchronized"] is synchronized
    enabled = (timers or {}).get("throughput", {}).get("enabled", True)
    assert ds["timers"]["throughput"].get("enabled", True) is enabled
    assert ("timers.throughput.synchronized is true" in caplog.text) is warns
