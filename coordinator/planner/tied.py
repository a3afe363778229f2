"""A tied embedding and head across pipeline stages, as the planner prices it.

When a tied model (`ModelConfig.tied_head`) is cut into stages, the first stage keeps the embedding's weight
and the last a copy (`atoll.node.tied`): after backward their gradients of it, vocab x d_model values each, are
summed over every holder of either copy. The planner adds that all-reduce to the first and last stage's
gradient sync (both wait on it before their optimizer step), and plans either every pipeline of a step cut or
every one whole, as the runtime trains (a pipeline that keeps embedding and head together has no copy).
"""

from __future__ import annotations

from collections.abc import Sequence

from atoll.coordinator.planner.cluster import Cluster, Island


def tied_params(model) -> int:
    """Values of the tied weight (vocab x d_model) of a tied model, 0 for an untied one."""
    c = model.config
    return c.vocab_size * c.d_model if c.tied_head else 0


def tied_copy_params(model, start: int, end: int) -> int:
    """Values of the tied weight's copy a stage of layers [start, end) holds besides its layers' own: vocab x
    d_model on the head's stage of a cut model (the embedding's stage holds the weight as its own layer's)."""
    return tied_params(model) if start > 0 and end == model.num_layers else 0


def holds_tied_weight(model, start: int, end: int) -> bool:
    """Whether a stage of layers [start, end) holds one of the tied weight's two copies (first or last stage of
    a cut tied model), which the runtime trains with plain AdamW rather than ZeRO."""
    return tied_params(model) > 0 and (start == 0) != (end == model.num_layers)


def tied_sync_seconds(cm, cluster: Cluster, first: Island, last: Island) -> float:
    """The all-reduce of the tied weight's gradient between the first stage's island and the last's: a ring of
    two inside one island, else the pair's link carrying the gradient each way (one message of its bytes)."""
    nbytes = tied_params(cm.model) * cm.grad_bytes_per_param
    if nbytes == 0:
        return 0.0
    if first.id == last.id:
        return cm.allreduce_seconds(nbytes, 2, first)
    link = cluster.link(first.id, last.id)
    if link is None:  # not directly connected: as slow as the slower island's own network, at the least
        return max(cm.allreduce_seconds(nbytes, 2, first), cm.allreduce_seconds(nbytes, 2, last))
    return cm.transfer_seconds(nbytes, link.bandwidth, link.latency_s)


def mixes_cuts(stage_counts: Sequence[int]) -> bool:
    """Whether pipelines of one step are some cut into stages and some whole (not trained with a tied head)."""
    return any(n > 1 for n in stage_counts) and any(n == 1 for n in stage_counts)
