"""The shard rule, the split on block boundaries and the merged progress: pure functions, no services."""

from __future__ import annotations

from contracts.jobstore import merge_shard_progress
from contracts.layout import Block
from contracts.records import dump
from worker.sharding import ShardPlan, choose_shards, split_rows


def test_shard_rule_and_split():
    rule = dict(min_shard_seconds=10.0)
    assert choose_shards(None, blocks=8, live_workers=4, estimated_seconds=100, **rule) == 4
    assert choose_shards(None, blocks=3, live_workers=4, estimated_seconds=100, **rule) == 3  # capped by blocks
    assert choose_shards(None, blocks=8, live_workers=4, estimated_seconds=25, **rule) == 2  # >= 10 s each
    assert choose_shards(None, blocks=8, live_workers=4, estimated_seconds=9, **rule) == 1  # small job
    assert choose_shards(None, blocks=8, live_workers=1, estimated_seconds=1e6, **rule) == 1  # one worker
    assert choose_shards(None, blocks=1, live_workers=8, estimated_seconds=1e6, **rule) == 1  # one block
    assert choose_shards(5, blocks=8, live_workers=1, estimated_seconds=0, **rule) == 5  # asked for: given
    assert choose_shards(50, blocks=8, live_workers=1, estimated_seconds=0, **rule) == 8

    def blocks(sizes):
        out, start = [], 0
        for i, n in enumerate(sizes):
            out.append(Block(i, start, start + n, (), (n,)))
            start += n
        return out

    assert split_rows(blocks([2] * 6), 2) == [(0, 6), (6, 12)]
    assert split_rows(blocks([2] * 6), 3) == [(0, 4), (4, 8), (8, 12)]
    assert split_rows(blocks([1] * 10), 3) == [(0, 3), (3, 7), (7, 10)]
    assert split_rows(blocks([2, 2, 1, 2, 2, 1]), 2) == [(0, 5), (5, 10)]
    assert split_rows(blocks([9, 1, 1]), 3) == [(0, 9), (9, 10), (10, 11)]  # every shard gets a block
    assert split_rows(blocks([4]), 3) == [(0, 4)]

    merged = merge_shard_progress({"shards": 3, "ranges": [[0, 4], [4, 8], [8, 12]], "rows_total": 12},
                                  {0: {"rows_done": 4, "rows_total": 4, "rows_per_second": 9.0},
                                   1: {"rows_done": 2, "rows_total": 4, "rows_per_second": 2.0}})
    assert dump(merged) == {"rows_done": 6, "rows_total": 12, "fraction": 0.5, "rows_per_second": 2.0,
                      "eta_seconds": 3.0}


def test_shard_plan_round_trips_and_ignores_unknown_keys():
    plan = ShardPlan(shards=2, ranges=[[0, 4], [4, 8]], rows_total=8, strategy="tiled", block_bytes=64,
                     mode="reverse", engine_plan=None)
    assert ShardPlan.from_json(plan.to_json()) == plan
    older = {"shards": 2, "ranges": [[0, 4], [4, 8]], "rows_total": 8, "strategy": "tiled", "later_key": 1}
    assert ShardPlan.from_json(older).block_bytes is None and ShardPlan.from_json(older).plan() is None
