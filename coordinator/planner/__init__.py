"""atoll.coordinator.planner: islands, slices and balanced pipelines (the Tangram decomposition).

The planner is a pure function of the model, the cluster (islands, links, devices), the training spec and
optional measured profiles; it never imports grpc.

Entry point::

    plan_job(model: ModelSpec, cluster: Cluster, train: TrainSpec,
             profiles: ProfileSet | None = None, options: PlannerOptions | None = None) -> Plan

raising `NoFeasiblePlan` (a ValueError naming the memory needed against the memory available) when the
model fits nowhere. `search_plan(...)` takes the same arguments and also returns the chosen candidate (its
per-stage times for the simulator and the picture) and search statistics.

Across regions joined by wide-area links the plan may train in outer mode (`plan.mode == "outer"`): each
region a replica group planned alone, training the whole global batch every inner step, the groups syncing
compressed pseudo-gradients every H inner steps (`outer`; the options' `outer_*` settings; `plan.outer.reason`
says why). `search_sync(...)` is the synchronous search alone.

Building a cluster:
- from a cluster file: `load_cluster("examples/clusters/mixed-a100-v100.toml")` (format in
  `atoll.coordinator.planner.cluster`); every [[group]] is an island;
- from live measurements (the coordinator): `Cluster.from_nodes(islands={"isl-0": ["n1", "n2"], ...},
  profiles={node_id: NodeProfile}, links=[LinkMeasurement, ...])`, with one device per node, and
  `ProfileSet.from_node_profiles(islands, profiles)` so each island's measured layer timings (its slowest
  node's) override the catalog estimate.

What the plan means:
- pipelines run data-parallel with each other, each on its own share of the global batch
  (micro_batch x num_micro_batches sequences); the replicas of the same layers in every pipeline
  all-reduce their gradients together;
- `micro_batch` is the sequences of one micro-batch of a pipeline; each stage shares it evenly among its
  `dp` replicas (micro_batch / dp each; the planner keeps it divisible), so stages of one pipeline may
  have different widths (FlashFlex's asymmetric shares); when widths are equal, replica r of a stage feeds
  replica r of the next;
- a stage's replicas form its data-parallel (and ZeRO) group; for live clusters `nodes` lists them in rank
  order; `send` is the activation link to the next stage: the codec the link would get, the raw bytes of
  one stream's share of a micro-batch and the predicted seconds.

Parts: `catalog` (device peak FLOPS and memory), `cluster` (islands, links, TOML), `profiles` (measured
timings), `costmodel` (compute, transfer, all-reduce, memory), `parallelizer` (the narrow API
cost(slice, island) -> IslandCost | None), `composer` (the search), `multipipe` (several pipelines), `outer`
(replica groups and their outer sync), `simulator` (event-driven 1F1B, and rounds of outer mode),
`report` (text), `picture` (PNG), `cli` (`atoll plan`).
"""

from atoll.coordinator.planner.catalog import CATALOG, DeviceSpec, device
from atoll.coordinator.planner.cluster import Cluster, ClusterFileError, Island, Link, load_cluster, parse_cluster
from atoll.coordinator.planner.composer import NoFeasiblePlan
from atoll.coordinator.planner.costmodel import CostModel, ExpectedRatioCodecModel, LinkCodecModel
from atoll.coordinator.planner.options import PlannerOptions, TrainSpec
from atoll.coordinator.planner.parallelizer import DefaultParallelizer, IslandCost, IslandParallelizer, SliceQuery
from atoll.coordinator.planner.planjob import PlanResult, plan_job, search_plan, search_sync
from atoll.coordinator.planner.profiles import ProfileSet
from atoll.coordinator.planner.simulator import LinkTimes, PipelineTimes, StageTimes, simulate, simulate_outer

plan = plan_job

__all__ = [
    "CATALOG", "Cluster", "ClusterFileError", "CostModel", "DefaultParallelizer", "DeviceSpec",
    "ExpectedRatioCodecModel", "Island", "IslandCost", "IslandParallelizer", "Link", "LinkCodecModel", "LinkTimes",
    "NoFeasiblePlan", "PipelineTimes", "PlanResult", "PlannerOptions", "ProfileSet", "SliceQuery", "StageTimes",
    "TrainSpec", "device", "load_cluster", "parse_cluster", "plan", "plan_job", "search_plan", "search_sync",
    "simulate", "simulate_outer",
]
