"""Tied embedding and head across pipeline stages, as Megatron-LM does it.

A model whose LM head reuses the token embedding (`ModelConfig.tied_head`: GPT-2, Llama 3.2 1B, Qwen2.5 0.5B)
can still be cut into stages: the first stage holds the embedding's weight, the last stage a copy of it
(`Head.lm.weight`, built by `atoll.node.model` from the same seeded draw, or read from the same pretrained
tensor). Each copy receives its own part of the gradient (the embedding's lookups on one, the head's matmul on
the other); after the stages' data-parallel averages, `TiedGradients` sums the two parts over a small process
group of every holder of either copy, so both hold the gradient of the tied weight and, stepping the same
AdamW from the same state, stay equal.

With data-parallel replicas (any widths, any number of pipelines) every holder of a copy already holds that
copy's averaged gradient, so each holder adds its gradient divided by the number of holders of its copy:
the group's sum is then exactly embedding part + head part, on every member.

Rules: the head's copy counts once in gradient clipping (the head's stage leaves it out of its norm, the
embedding's stage counts the summed gradient); checkpoints keep the copy with the head's layer (so a stage
resumes from its own files; a checkpoint written by a cut that kept embedding and head together gives the
head's stage the embedding's tensor); `atoll export` writes the tied Hugging Face folder (one tensor).
Tensor parallelism is not combined with the first or last stage of a tied model cut into stages (`check_tied_plan`
says so; the planner plans those two at tp = 1, and may shard the stages between them or a whole model's one
stage: `atoll.node.tp`), and the first
and last stages of such a model train with plain AdamW and the segment averager where the plan asks for ZeRO
(the runner logs it); the stages between them are not affected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from atoll.plan import Plan
from atoll.node.dataparallel import CollectiveCancelled, CollectiveError, collective_failed, wait_collective


class TiedPlanError(ValueError):
    """A plan cuts a tied model in a way the runtime does not train; the message says what to change."""


def tied_holders(plan: Plan, pipelines: Sequence[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(embedding holders, head holders) of a tied model cut into stages: the first and last stage's nodes of
    each of `pipelines`, in plan order (the members of the tied-gradient group, embedding holders first)."""
    emb: list[str] = []
    head: list[str] = []
    for p in pipelines:
        stages = plan.pipelines[p].stages
        emb.extend(n for n in stages[0].nodes if n not in emb)
        head.extend(n for n in stages[-1].nodes if n not in head)
    return tuple(emb), tuple(head)


def check_tied_plan(plan: Plan, pipelines: Sequence[int]) -> None:
    """Refuse what the runtime does not combine with a tied model cut into stages."""
    cut = [len(plan.pipelines[p].stages) > 1 for p in pipelines]
    if not any(cut):
        return
    if not all(cut):
        raise TiedPlanError("a tied model (tied_head) is cut into stages in some pipelines and kept whole in "
                            "others; plan every pipeline with more than one stage, or every one with one")
    for p in pipelines:
        stages = plan.pipelines[p].stages
        for k, st in ((0, stages[0]), (len(stages) - 1, stages[-1])):
            if st.tp > 1:
                raise TiedPlanError(f"pipeline {p} shards stage {k} of a tied model with tp = {st.tp}; tensor "
                                    "parallelism is not combined with a stage holding a copy of the tied weight "
                                    "(the first and last): plan tp = 1 there, or untie the head (tied_head = false)")


def tie_gradients(module, plan: Plan, pipelines: Sequence[int], node_id: str, averager,
                  make_group: Callable[[str, int, int], dist.ProcessGroup]):
    """The averager a stage of a tied model cut into stages trains with: `averager` followed by the tied sum when
    this stage holds a copy of the tied weight (`make_group(name, rank, size)` joins the group), else `averager`."""
    if module.tied_copy is None and not module.ties_embedding:
        return averager
    check_tied_plan(plan, pipelines)
    emb, head = tied_holders(plan, pipelines)
    members = emb + head
    if module.ties_embedding:
        param, mine, rank = module.layers["0"].tok.weight, len(emb), emb.index(node_id)
    else:
        param, mine, rank = module.tied_copy, len(head), len(emb) + head.index(node_id)
    group = make_group("tied", rank, len(members))
    return WithTiedGradients(averager, TiedGradients(param, group, holders_of_mine=mine))


class TiedGradients:
    """Sums one tied weight copy's gradient with the other copy's over every holder of either."""

    def __init__(self, param: torch.nn.Parameter, group: dist.ProcessGroup, *, holders_of_mine: int):
        if holders_of_mine <= 0:
            raise ValueError(f"holders_of_mine must be positive, got {holders_of_mine}")
        self.param, self.group, self.share = param, group, 1.0 / holders_of_mine

    def sum_(self, timeout: timedelta) -> None:
        p = self.param
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        flat = g.mul(self.share)
        what = f"tied-weight gradient sum over {self.group.size()} holders"
        started = time.monotonic()
        work = self.group.allreduce([flat])
        try:
            wait_collective(work, timeout, what)
        except CollectiveCancelled:
            raise
        except RuntimeError as e:
            raise CollectiveError(collective_failed(what, started, timeout, e)) from e
        g.copy_(flat)


class WithTiedGradients:
    """A stage's gradient averager followed by the tied-weight sum (the stage calls `average_` once per step)."""

    def __init__(self, inner, tied: TiedGradients):
        self.inner, self.tied = inner, tied

    def average_(self, params, timeout: timedelta) -> None:
        if self.inner is not None:
            self.inner.average_(params, timeout)
        self.tied.sum_(timeout)

    def __getattr__(self, name: str):  # parts, weight, local: the inner averager's, for callers that look
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
