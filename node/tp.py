"""Tensor parallelism inside a node: one stage replica's layers sharded over `tp` ranks with DTensor.

Plan semantics. A stage with `StagePlan.tp = t > 1` lists `dp x t` node ids, replica-major:
`nodes[r * t + k]` is tp rank `k` of data-parallel replica `r` (`atoll.node.placement` reads it so). Each id is
one `atoll node` process; on a GPU machine, one process per GPU of that machine, so the tp group's collectives
run over NCCL on the machine's own links (gloo between CPU processes in tests).

Process groups. `torch.distributed.tensor` builds a `DeviceMesh` from the *default* process group: on this
torch (2.13) `DeviceMesh.from_group` and `init_device_mesh` both read the caller's global rank from it, and a
group made straight from a store (as the runner's other groups are) has no global rank. So a tp rank makes
its tp group its process's default group (`init_process_group` over the epoch's rendezvous store, under the
stage replica's own prefix) and builds the 1-D mesh with `init_device_mesh`; `TensorParallel.close` destroys
it at the end of the plan's run. One node per process, then: a process that already has a default group is
refused with a message that says so.

Sharding (Megatron layout, `torch.distributed.tensor.parallel`), from the full seeded (or loaded) layers, so
the shards are exactly the unsharded model's weights:
- blocks: `qkv` column-wise with heads split (rank k holds q heads `[k n/t, (k+1) n/t)` and the kv heads they
  read: the rows of q, k and v are reordered so each rank's contiguous shard is its own q|k|v, and the block's
  head counts lowered to the shard's), `proj` row-wise; MLP `fc` column-wise (SwiGLU: gate and up reordered
  the same way), `out` row-wise; norms replicated. Needs t to divide n_heads, n_kv_heads and the MLP width;
  a head width other than d_model / n_heads (`head_dim`) cuts the same way, whole heads per rank. Qwen3's
  per-head q/k norms are replicated, but each rank runs them over its own heads only, so a rank's gradient of
  their weights is a partial sum: backward sums it over the tp group as it reaches the weight (`_HeadShardNorm`),
  and the weight stays a plain replicated tensor like the other norms'.
- embedding: the token table vocab-parallel (row-wise over the vocabulary, the lookup's partial sums
  all-reduced); learned positions replicated (a seq_len x d table).
- head: the LM head vocab-parallel (column-wise), its logits all-gathered so the loss is computed as in one
  process (`lm_loss` and the schedule unchanged; `loss_parallel` would spare the gather of b x s x vocab
  logits per micro-batch, at the price of running every last-stage backward under its context).
- a tied head (embedding and head share a weight) on the embedding's stage: the table is vocab-parallel as
  above, and the head's matmul takes that sharded table (`Head.tied_linear`, the head's vocab-parallel form:
  its logits all-gathered); the weight's gradient is the sum of both uses' on each rank's rows. A tied model
  cut into stages keeps its first and last stage (the copies of the tied weight, `atoll.node.tied`) at tp = 1.

Runtime. Activations enter and leave a tp stage through its tp rank 0 only (`share` broadcasts what rank 0
received to the others; only rank 0 sends), so the pipeline transport is unchanged. Every rank computes the
same replicated outputs and input gradients. Gradients are kept in their parameter's placement (the
vocab-parallel embedding's backward leaves its gradient replicated; each rank keeps its rows): data-parallel
averaging runs per tp rank on local shards (`local_params`); for the clipping norm every tp rank adds its
shards and rank 0 the replicated parameters (`squared_norm`) to the pipeline's norm group, which holds every
tp rank, so each element counts once. Checkpoints hold whole layers:
`full_state` gathers shards to tp rank 0 (reordering undone) in the `atoll.node.slice_state` format, and a
checkpoint of any cut or tp degree is loaded into the full slice before `shard` cuts it and its AdamW state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from atoll.modelspec import ModelConfig
from atoll.node.dataparallel import CollectiveCancelled, arrive_on_devices, wait_collective
from atoll.node.model import Block, Embedding, Head, StageModule
from atoll.node.slice_state import FORMAT

log = logging.getLogger("atoll.node.tp")

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
_MAX_NDIM = 6


class TensorParallelError(RuntimeError):
    """Tensor parallelism cannot be set up or a tp collective failed; the message says what to change."""


def check_shardable(config: ModelConfig, tp: int) -> None:
    """Raise ValueError (saying what to change) unless `tp` ranks can split this model's blocks evenly."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    for what, n in (("model.n_heads", config.n_heads), ("model.n_kv_heads", config.kv_heads),
                    ("the MLP width (model.ffn_hidden)", config.ffn)):
        if n % tp:
            raise ValueError(f"tp = {tp} does not divide {what} = {n}: plan a tp degree that divides it")


def _qkv_order(block: Block, tp: int) -> torch.Tensor:
    """Row order of the fused qkv weight that makes rank k's contiguous shard its q heads, then k, then v."""
    hd, n, kv = block.head_dim, block.n_heads, block.kv_heads
    q = torch.arange(n * hd).view(tp, -1)
    k = (n * hd + torch.arange(kv * hd)).view(tp, -1)
    v = (n * hd + kv * hd + torch.arange(kv * hd)).view(tp, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1)


def _swiglu_order(ffn: int, tp: int) -> torch.Tensor:
    """Row order of the fused gate|up weight that makes rank k's contiguous shard its gate rows, then up."""
    gate = torch.arange(ffn).view(tp, -1)
    return torch.cat([gate, ffn + gate], dim=1).reshape(-1)


class _SumGradOverTp(torch.autograd.Function):
    """The identity forward; backward sums the gradient over the tp group (every rank's backward reaches it in the
    same order, as DTensor's own collectives)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _HeadShardNorm(nn.Module):
    """A block's q or k norm (one weight over head_dim, shared by every head) on a tp rank holding some of the
    heads: its forward is the norm's own, and the weight's gradient from this rank's heads is summed over the tp
    group. The weight keeps its name (`q_norm.weight`), so checkpoints are those of the unsharded block."""

    def __init__(self, norm: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.weight = norm.weight
        del norm.weight  # the inner norm runs with the summing view of it, set per forward
        self.inner, self.group = norm, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner.weight = _SumGradOverTp.apply(self.weight, self.group)
        try:
            return self.inner(x)
        finally:
            del self.inner.weight


def shard_module(module: StageModule, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Shard `module`'s layers in place over the 1-D `mesh`; return the row order applied per parameter name.

    A parameter listed in the result holds its rows in that order (`full[order]`) before being split; the
    others are split (or replicated) as they are.
    """
    tp = mesh.size()
    check_shardable(module.config, tp)
    orders: dict[str, torch.Tensor] = {}
    for idx, layer in module.layers.items():
        prefix = f"layers.{idx}."
        if isinstance(layer, Block):
            fused = {"qkv": _qkv_order(layer, tp)}
            if not layer.gpt:
                fused["fc"] = _swiglu_order(layer.out.in_features, tp)
            with torch.no_grad():
                for sub, order in fused.items():
                    for pname, p in getattr(layer, sub).named_parameters():
                        p.copy_(p[order.to(p.device)])
                        orders[f"{prefix}{sub}.{pname}"] = order
            parallelize_module(layer, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                             "fc": ColwiseParallel(), "out": RowwiseParallel()})
            if layer.q_norm is not None and layer.k_norm is not None:
                group = mesh.get_group()
                layer.q_norm, layer.k_norm = _HeadShardNorm(layer.q_norm, group), _HeadShardNorm(layer.k_norm, group)
            layer.n_heads //= tp
            layer.kv_heads //= tp
        elif isinstance(layer, Embedding) and (not module.config.tied_head or module.is_last):
            # a tied table is sharded where the head using it is too (a stage holding the whole model)
            parallelize_module(layer, mesh, {"tok": RowwiseParallel(input_layouts=Replicate())})
        elif isinstance(layer, Head) and layer.lm is not None:
            parallelize_module(layer, mesh, {"lm": ColwiseParallel(output_layouts=Replicate())})
        elif isinstance(layer, Head) and module.is_first:
            layer.tied_linear = _vocab_parallel_linear(mesh)
    return orders


def _vocab_parallel_linear(mesh: DeviceMesh) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A tied head's matmul with the vocab-parallel embedding table (a DTensor sharded over its rows), as
    `ColwiseParallel(output_layouts=Replicate())` runs an untied head: the input replicated (its gradient's partial
    sums all-reduced in backward), each rank's logits of its rows, all-gathered."""

    def linear(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
        return F.linear(x, weight).redistribute(mesh, [Replicate()]).to_local()

    return linear


def _unorder(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    if order is None:
        return t
    out = torch.empty_like(t)
    out[order.to(t.device)] = t
    return out


def _settle(p: DTensor) -> DTensor:
    """`p`'s gradient in `p`'s own placement. The vocab-parallel embedding's backward leaves its gradient
    replicated; each rank keeps its rows (a local slice, no communication)."""
    g = p.grad
    assert isinstance(g, DTensor)
    if tuple(g.placements) != tuple(p.placements):
        with torch.no_grad():
            p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g


def forget_meshes() -> None:
    """Clear DTensor's caches of sharding decisions. They are keyed by specs whose meshes compare equal when their
    ranks' layout is (the process's own rank is not part of a mesh's equality), and the outputs they hold name the
    mesh they were first computed on, with that mesh's coordinate of this process. A process whose tp rank
    changes from one plan to the next (rank 1 of one group, rank 0 of the next) would otherwise cut a
    redistributed tensor by its old rank: the backward of the vocab-parallel head handed each rank the other's
    slice of the gradient."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:  # the native fast path's cache
        clear()
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(propagator, "propagate_op_sharding", None),
                   getattr(propagator, "_propagate_tensor_meta_cached", None)):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    from torch.distributed.tensor import _redistribute

    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    if transforms is not None and hasattr(transforms, "cache_clear"):
        transforms.cache_clear()
    planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if planners is not None:
        planners()


class TensorParallel:
    """One rank's handle on the tp group of its stage replica: sharding, activation sharing, norms, state."""

    def __init__(self, mesh: DeviceMesh, *, timeout: timedelta, owns_default_group: bool = False):
        if mesh.ndim != 1:
            raise ValueError(f"tensor parallelism needs a 1-D device mesh, got {mesh.ndim} dimensions")
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.size = mesh.size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else \
            torch.device(mesh.device_type)
        self.timeout = timeout
        self.orders: dict[str, torch.Tensor] = {}
        self._owns_default_group = owns_default_group

    @classmethod
    def join(cls, store: dist.Store, prefix: str, *, rank: int, size: int, device: torch.device,
             timeout: timedelta) -> "TensorParallel":
        """Form the tp group of `size` ranks named `prefix` in `store` as this process's default group.

        Every rank of the group calls it with the same prefix; it returns once all have joined (bounded by
        `timeout`). gloo on CPU, NCCL on CUDA (`device` is this rank's GPU), gloo where ranks share a GPU
        (`atoll.node.dataparallel.collective_backend`).
        """
        if not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} is outside a tp group of {size}")
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already has a default torch.distributed process group, and a tensor-parallel "
                "stage makes its tp group the default one (DeviceMesh is built from it): run one node per process")
        device_id = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
            device_id = torch.device("cuda", torch.cuda.current_device())
        # torch names the default group after a process-wide counter that each init_process_group raises, also
        # one that fails (a peer that never came), and only destroying a default group resets it: ranks whose
        # counters differ look for each other under different keys and never meet again. The prefix already
        # tells groups apart, so every rank starts from the same name.
        distributed_c10d._world.group_count = 0
        forget_meshes()
        prefixed = dist.PrefixStore(prefix, store)
        # a newer plan ends the wait for peers not coming
        backend, why = arrive_on_devices(prefixed, rank=rank, size=size, device=device, timeout=timeout)
        if device.type == "cuda":  # gloo where ranks share a GPU
            log.info("tp group %s of %d ranks runs over %s: %s", prefix.rstrip("/"), size, backend, why)
        # device_id binds an NCCL communicator to this rank's GPU at once; gloo takes no device
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=size, timeout=timeout,
                                device_id=device_id if backend == "nccl" else None)
        try:
            mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("tp",))
            return cls(mesh, timeout=timeout, owns_default_group=True)
        except BaseException:
            dist.destroy_process_group()
            raise

    def close(self) -> None:
        """Leave the tp group (destroys the process's default group when `join` made it)."""
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
            forget_meshes()
        self._owns_default_group = False

    @property
    def is_leader(self) -> bool:
        """Tp rank 0: the rank that exchanges activations with the neighbouring stages."""
        return self.rank == 0

    # --- set-up ------------------------------------------------------------------------------------

    def shard(self, module: StageModule, optimizer: torch.optim.Optimizer,
              build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """Shard the full `module` in place and return an optimizer over its shards.

        `optimizer` is the full module's (possibly loaded from a checkpoint); its per-parameter state is cut
        the same way as its parameter and carried into the new optimizer from `build_optimizer(module)`.
        """
        before = dict(module.named_parameters())
        states = {n: optimizer.state[p] for n, p in before.items() if optimizer.state.get(p)}
        self.orders = shard_module(module, self.mesh)
        sharded = build_optimizer(module)
        for name, p in module.named_parameters():
            st = states.get(name)
            if st is None:
                continue
            full_shape = before[name].shape
            sharded.state[p] = {k: self._cut(name, p, v) if torch.is_tensor(v) and v.shape == full_shape else v
                                for k, v in st.items()}
        return sharded

    def _cut(self, name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """`full` (a whole parameter's worth of state) cut as parameter `name` is."""
        order = self.orders.get(name)
        if order is not None:
            full = full[order.to(full.device)]
        if not isinstance(p, DTensor):
            return full
        # every rank holds the same full tensor (same seed or same checkpoint): each keeps its own shard
        return distribute_tensor(full.to(p.device_mesh.device_type), p.device_mesh, p.placements, src_data_rank=None)

    # --- per step ----------------------------------------------------------------------------------

    def share(self, t: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's tensor `t` on every rank of the tp group (the others pass None): a broadcast of a small
        header (dtype, shape), then of the data."""
        header = torch.zeros(2 + _MAX_NDIM, dtype=torch.int64, device=self.device)
        if self.is_leader:
            if t is None:
                raise ValueError("tp rank 0 must pass the tensor it shares")
            if t.dtype not in _DTYPES or t.ndim > _MAX_NDIM:
                raise ValueError(f"cannot share a {t.dtype} tensor of {t.ndim} dimensions over the tp group")
            header[0], header[1] = _DTYPES.index(t.dtype), t.ndim
            header[2:2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
            t = t.detach().to(self.device).contiguous()
        self._broadcast(header, "activation header")
        if not self.is_leader:
            ndim = int(header[1])
            t = torch.empty(tuple(header[2:2 + ndim].tolist()), dtype=_DTYPES[int(header[0])], device=self.device)
        assert t is not None
        self._broadcast(t, "activation")
        return t

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        # a rank but 0 waits here for rank 0's next activation: a superseded plan ends that wait at once
        # (`cancel_collectives_on`), so it meets its peers' handover instead of its group's timeout
        try:
            wait_collective(dist.broadcast(t, group=self.group, group_src=0, async_op=True), self.timeout,
                            f"tp broadcast of the {what}")
        except CollectiveCancelled:
            raise
        except RuntimeError as e:
            raise TensorParallelError(f"broadcast of the {what} over the tp group of {self.size} failed or timed "
                                      f"out after {self.timeout} (a tp rank died or is stuck): {e}") from e

    def squared_norm(self, params: Iterable[nn.Parameter]) -> float:
        """This rank's share of the squared gradient norm: its shards, plus replicated gradients on rank 0 only,
        so the sum over the tp group counts every element once."""
        norms = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                g = _settle(p)
                if any(pl.is_partial() for pl in g.placements):
                    raise TensorParallelError(f"a gradient is still a partial sum ({g.placements}); the tp plan "
                                              "must reduce it before the norm")
                if not any(pl.is_shard() for pl in g.placements) and not self.is_leader:
                    continue
                g = g.to_local()
            elif not self.is_leader:
                continue
            norms.append(torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32))
        if not norms:
            return 0.0
        return float(torch.sum(torch.stack(norms).double() ** 2))

    def local_params(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """Leaf views of the parameters' local shards whose `.grad` aliases the local gradient shard, for
        code written for plain tensors (data-parallel averaging within one tp rank)."""
        out = []
        with torch.no_grad():
            for p in params:
                if not isinstance(p, DTensor):
                    out.append(p)
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                view = p.to_local().detach().requires_grad_(True)
                view.grad = _settle(p).to_local()
                out.append(view)
        return out

    # --- checkpoints -------------------------------------------------------------------------------

    def full_state(self, module: StageModule,
                   optimizer: torch.optim.Optimizer | Mapping[nn.Parameter, Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None, *, group: dist.ProcessGroup | None = None,
                   timeout: timedelta | None = None) -> dict[str, Any] | None:
        """The whole layers' state (`atoll.node.slice_state` format) on rank 0, None on the others.

        `optimizer` is the stage's AdamW over the shards, or the per-parameter states a ZeRO optimizer gathered
        (`ZeroOptimizer.consolidated_state`: each state tensor of a shard's local shape, placed here as the
        parameter is). A collective: every rank of the tp group calls it, in the same step, with the same
        parameters holding state. With `group` (the same ranks in another group) the shards are gathered over
        it, each gather bounded by `timeout`: what a superseded tp stage hands over, when its own group may hold a
        collective the supersession abandoned (DTensor's gathers run on that one).
        """
        def whole(name: str, t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):
                full = t.full_tensor() if group is None else self._gather(name, t, group, timeout)
                if full is None:  # not rank 0: gathered there
                    return t.new_empty(0)
                t = _unorder(full, self.orders.get(name))
            return t.detach().cpu().clone()

        def placed(p: nn.Parameter, v: Any) -> Any:
            if not torch.is_tensor(v) or isinstance(v, DTensor) or not isinstance(p, DTensor) or v.ndim == 0:
                return v
            return DTensor.from_local(v.to(self.device), p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())

        tensors = {k: whole(k, v) for k, v in module.state_dict().items()}
        opt: dict[str, dict[str, torch.Tensor]] = {}
        if optimizer is not None:
            states = optimizer.state if isinstance(optimizer, torch.optim.Optimizer) else optimizer
            for name, p in module.named_parameters():
                st = states.get(p)
                if st:
                    opt[name] = {k: whole(name, placed(p, v)) if torch.is_tensor(v) else torch.tensor(v)
                                 for k, v in st.items()}
        if not self.is_leader:
            return None
        return {"format": FORMAT, "model": module.config.to_dict(), "start": module.start, "end": module.end,
                "tensors": tensors, "optimizer": opt, "extra": dict(extra or {})}

    def _gather(self, name: str, t: DTensor, group: dist.ProcessGroup, timeout: timedelta | None
                ) -> torch.Tensor | None:
        """`t.full_tensor()` over `group`, on rank 0 (None on the others)."""
        from atoll.node.dataparallel import wait_collective

        local, placement = t.to_local(), t.placements[0]
        if not placement.is_shard():
            return local
        d = placement.dim  # type: ignore[attr-defined]
        n = t.shape[d]
        chunk = -(-n // self.size)  # torch.chunk's split, as DTensor's Shard cuts
        sizes = [max(0, min(chunk, n - r * chunk)) for r in range(self.size)]
        if local.shape[d] < chunk:
            pad = list(local.shape)
            pad[d] = chunk - local.shape[d]
            local = torch.cat([local, local.new_zeros(pad)], dim=d)
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_leader else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        wait_collective(group.gather([parts] if self.is_leader else [], [local.contiguous()], opts),
                        timeout or timedelta(seconds=60), f"tp handover gather of {name}")
        if not self.is_leader:
            return None
        return torch.cat([x.narrow(d, 0, k) for x, k in zip(parts, sizes) if k], dim=d)

