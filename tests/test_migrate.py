"""Earlier versions' checkpoints, brought to today's format in one place (ds_lowcomm/checkpoint/
migrate.py): each upgrade against the file content written out by hand as that version saved it."""
import pytest
import torch

from ds_lowcomm.checkpoint import CheckpointError
from ds_lowcomm.checkpoint.migrate import check_loadable, upgrade_meta, upgrade_rank_file

pytestmark = pytest.mark.unit


def test_desloc_moments_in_the_rank_file_move_to_its_shards():
    m, v, a, b, master = (torch.full((4,), float(i)) for i in range(5))
    before = {"shards": {"master": master}, "guard": None,
              "mode": {"world_size": 2, "shard_group_size": 1, "step": 7, "exp_avg": m, "exp_avg_sq": v,
                       "anchor": a, "outer_buf": b}}
    after = upgrade_rank_file(before, {"mode": "desloc"})
    assert set(after["shards"]) == {"master", "exp_avg", "exp_avg_sq", "anchor", "outer_buf"}
    assert after["shards"]["exp_avg"] is m and after["shards"]["outer_buf"] is b
    assert after["mode"] == {"world_size": 2, "shard_group_size": 1, "step": 7}
    assert "exp_avg" in before["mode"]  # the file as read is left alone


def test_demo_momentum_is_renamed_wherever_it_was():
    delta = torch.ones(3)
    in_rank_part = upgrade_rank_file({"shards": {"master": torch.zeros(3)}, "mode": {"delta": delta}},
                                     {"mode": "demo"})
    in_shards = upgrade_rank_file({"shards": {"master": torch.zeros(3), "delta": delta}, "mode": {}},
                                  {"mode": "demo"})
    for after in (in_rank_part, in_shards):
        assert after["shards"]["momentum"] is delta and "delta" not in after["shards"]


def test_acco_rank_part_gets_its_weights_and_a_first_format_file_its_frame():
    old = {"accumulator": torch.zeros(2), "micro_batches": 3, "since_switch": 1}
    after = upgrade_rank_file(old, {"mode": "acco", "format": "ds_lowcomm/1"})  # the mode's part alone
    assert after["shards"] == {} and after["guard"] is None
    assert after["mode"]["weights"] == [3, 3] and after["mode"]["micro_batches"] == 3


def test_desloc_rounds_were_counted_as_steps():
    assert upgrade_meta({"mode": "desloc", "step": 12})["rounds"] == 12
    assert upgrade_meta({"mode": "desloc", "step": 12, "rounds": 5})["rounds"] == 5
    assert "rounds" not in upgrade_meta({"mode": "zero1", "step": 12})


@pytest.mark.parametrize("mode", ["acco", "demo", "desloc"])
def test_first_format_per_rank_state_is_refused_with_the_way_out(mode):
    saved = {"format": "ds_lowcomm/1", "mode": mode}
    with pytest.raises(CheckpointError, match="load_optimizer_states=False"):
        check_loadable(saved, load_optimizer_states=True)
    check_loadable(saved, load_optimizer_states=False)  # the weights still load
    check_loadable({"format": "ds_lowcomm/1", "mode": "zero1"}, load_optimizer_states=True)
