"""Free order: a pipeline may visit an island twice (V100 / A100 / V100), and the plan prefers one pipeline."""

from __future__ import annotations

import math

from atoll.coordinator.planner import IslandCost, SliceQuery, TrainSpec, parse_cluster, search_plan
from atoll.coordinator.planner.composer import Composer, split_island
from atoll.coordinator.planner.costmodel import CostModel
from atoll.coordinator.planner.simulator import simulate
from atoll.modelspec import ModelConfig, ModelSpec

# embedding, 6 blocks, head
SMALL = ModelSpec.from_config(ModelConfig(name="t8", vocab_size=8000, d_model=1024, n_layers=6, n_heads=8,
                                          seq_len=512))

CLUSTER = parse_cluster("""
[[group]]
name = "v100"
device = "V100-32GB"
count = 4
gpus_per_node = 4
[[group]]
name = "a100"
device = "A100-80GB"
count = 4
gpus_per_node = 4
""")


class ByKind:
    """An island parallelizer with a fixed time per layer kind and sequence on each island: here the V100s
    run the embedding and the head fast and the blocks slowly, the A100s the other way round."""

    SECONDS = {"v100": {"embedding": 0.001, "block": 0.008, "head": 0.001},
               "a100": {"embedding": 0.010, "block": 0.002, "head": 0.010}}

    def __init__(self, model: ModelSpec) -> None:
        self.kinds = [layer.kind for layer in model.layers]

    def cost(self, q: SliceQuery, island) -> IslandCost | None:
        t = sum(self.SECONDS[island.id][k] for k in self.kinds[q.start:q.end]) * q.micro_batch
        return IslandCost(forward_s=t / 3, backward_s=2 * t / 3, memory_bytes=0.0, dp=q.dp, zero=0, recompute=False,
                          micro_batch=q.micro_batch)


def test_a_v100_a100_v100_order_is_found_when_it_is_better() -> None:
    train = TrainSpec(global_batch=32, seq_len=512)
    cm = CostModel(SMALL, train)
    comp = Composer(cost_model=cm, cluster=CLUSTER, parallelizer=ByKind(SMALL))
    contiguous = [c for s in comp.setups() if (c := comp.chain_best(s)) is not None]
    best_contiguous = min(simulate(c.times).step_time_s for c in contiguous)
    assert all(len(set(c.order)) == len(c.order) for c in contiguous)

    top = Composer(cost_model=cm, cluster=CLUSTER, parallelizer=ByKind(SMALL)).search()
    best = top[0]
    assert best.order == ("v100", "a100", "v100")
    assert best.stages[0].island.id == "v100" and best.stages[0].start == 0
    assert best.stages[-1].island.id == "v100" and best.stages[-1].end == SMALL.num_layers
    assert best.step_s < 0.9 * best_contiguous
    # the two parts of the island hold no more devices than it has
    assert sum(st.cost.dp for st in best.stages if st.island.id == "v100") <= 4

    plan = search_plan(SMALL, CLUSTER, train, parallelizer=ByKind(SMALL)).plan
    plan.validate(SMALL.num_layers)
    assert [s.island for s in plan.pipelines[0].stages][0] == "v100"
    assert [s.island for s in plan.pipelines[0].stages][-1] == "v100"


def test_contiguous_chains_stay_when_they_are_better() -> None:
    # the planner's own cost model on a plain mixed cluster: nothing gained by visiting an island twice
    top = Composer(cost_model=CostModel(SMALL, TrainSpec(global_batch=32, seq_len=512)), cluster=CLUSTER).search()
    assert top and len(set(top[0].order)) == len(top[0].order)


def test_split_island_cuts_between_nodes() -> None:
    isl = parse_cluster('[[group]]\nname = "g"\ndevice = "A100-80GB"\ncount = 32\ngpus_per_node = 8\n').islands[0]
    front, back = split_island(isl, 0.5)  # type: ignore[misc]
    assert (front.gpus, back.gpus) == (16, 16) and front.id == back.id == "g"
    assert split_island(isl, 0.25)[0].gpus == 8  # type: ignore[index]
    assert split_island(isl, 0.9)[0].gpus == 24  # type: ignore[index]  # never the whole island
    one_node = parse_cluster('[[group]]\nname = "n"\ndevice = "V100-32GB"\ncount = 4\n').islands[0]
    assert [p.gpus for p in split_island(one_node, 0.5)] == [2, 2]  # type: ignore[union-attr]
    single = parse_cluster('[[group]]\nname = "s"\ndevice = "T4"\ncount = 1\n').islands[0]
    assert split_island(single, 0.5) is None
    assert math.isclose(sum(p.gpus for p in split_island(one_node, 0.25)), 4)  # type: ignore[union-attr]
