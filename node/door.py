"""Tensors checked at the door: every activation and activation-gradient a stage receives, and the loss it
computes, before any of it can poison a step.

The check is one reduction per tensor, its L2 norm in fp32 (`tensor_norm`), taken on the tensor's device where
it is decoded: on the receive thread, beside the codec's decode, off the stage's critical path. A norm that is
not finite means a non-finite element (or one so large that its square overflows fp32, |x| > 1.8e19: as bad).
A finite norm is judged against that link's running statistics (`NormGauge`, one per sender and direction):

- an EWMA of the log-norm (weight `alpha`, about 20 tensors of memory, so the slow drift of a training run is
  followed) and an EWMA of the absolute deviation from it (a robust spread: one wild value moves it by alpha,
  never squared);
- warm-up: the first `warmup` tensors of a link only build the statistics (the non-finite check still applies);
- a tensor is an outlier when its log-norm is more than `band` = max(`spread_k` x deviation, ln(`min_factor`))
  from the mean: never closer than a factor of `min_factor` (20) either way, however steady the link has been.
  Honest tensors of one link move by a few percent from micro-batch to micro-batch and drift by less than a
  factor of two over the ~5 steps the EWMA remembers, even in the first steps of a run; a neighbour that sends
  x100 or x1e-3 of its usual norm is two factors of 20 away from them.
- an outlier does not update the statistics (a sender cannot drag them towards its own values with bad
  tensors).

A rejected tensor is replaced, for the rest of the step, by the last good tensor of its link (zeros before the
first): the step is skipped everywhere anyway (`atoll.node.stage`), and what this stage sends on stays of
ordinary size, so no neighbour downstream of it blames this node for the sender's tensor.

The loss a last stage computes is judged the same way, micro-batch by micro-batch (`check_loss`): a non-finite loss,
or one above `loss_spike` times its running mean (after `loss_warmup` micro-batches), skips the step, and the
activation-gradient of that micro-batch is not sent upstream as it is (`PipelineStage`). Such an offence names this
stage, not a sender: it is not counted towards a quarantine (a diverging run is the model's, not one node's).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from atoll.node.transport import Direction, TensorKey

NON_FINITE = "non-finite"
NORM = "norm"
LOSS = "loss"


def tensor_norm(t: torch.Tensor) -> float:
    """The L2 norm of `t` in fp32, one reduction on its own device: inf or nan when an element is not finite."""
    if t.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(t.detach(), 2.0, dtype=torch.float32))


@dataclass(frozen=True, kw_only=True)
class DoorConfig:
    """How received tensors and the local loss are judged (see the module docstring for why these values)."""

    alpha: float = 0.05
    """Weight of a new tensor in a link's EWMAs of log-norm and of its absolute deviation."""
    warmup: int = 20
    """Tensors of a link that only build its statistics (non-finite ones are still rejected)."""
    spread_k: float = 8.0
    """Half-width of the band in deviations of the log-norm."""
    min_factor: float = 20.0
    """The band is never narrower than this factor either way."""
    loss_warmup: int = 20
    """Micro-batch losses that only build the statistics (a non-finite loss is still an offence)."""
    loss_spike: float = 4.0
    """A loss above this many times its running mean (an EWMA of the log-loss) is a spike."""

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if self.warmup < 1 or self.loss_warmup < 1:
            raise ValueError(f"warmup and loss_warmup must be >= 1, got {self.warmup}, {self.loss_warmup}")
        if not self.spread_k > 0 or not self.min_factor > 1.0 or not self.loss_spike > 1.0:
            raise ValueError(f"spread_k must be > 0, min_factor and loss_spike > 1; got {self.spread_k}, "
                             f"{self.min_factor}, {self.loss_spike}")


@dataclass
class NormGauge:
    """Running statistics of one link's log-norms (or of a stage's log-loss)."""

    seen: int = 0
    mean: float = 0.0
    """EWMA of the log-norm (the plain mean of the first 1/alpha values, so the warm-up does not start at 0)."""
    dev: float = 0.0
    """EWMA of |log-norm - mean|."""

    def band(self, cfg: DoorConfig) -> float:
        return max(cfg.spread_k * self.dev, math.log(cfg.min_factor))

    def outside(self, log_norm: float, cfg: DoorConfig, warmup: int) -> bool:
        """Whether `log_norm` is outside the band (False during warm-up)."""
        return self.seen >= warmup and abs(log_norm - self.mean) > self.band(cfg)

    def add(self, log_norm: float, cfg: DoorConfig) -> None:
        self.seen += 1
        w = max(cfg.alpha, 1.0 / self.seen)
        if self.seen > 1:
            self.dev += w * (abs(log_norm - self.mean) - self.dev)
        self.mean += w * (log_norm - self.mean)

    def expected(self, cfg: DoorConfig) -> tuple[float, float]:
        """The band's (low, high) norms."""
        b = self.band(cfg)
        return math.exp(self.mean - b), math.exp(self.mean + b)


@dataclass(frozen=True, kw_only=True)
class Offence:
    """A tensor rejected at the door (or a bad local loss): who sent it, what it was and why."""

    sender: str
    """The node that sent the tensor; for a local loss, this node."""
    step: int
    micro_batch: int
    direction: Direction | str
    """"forward" (an activation), "backward" (an activation-gradient) or "loss"."""
    kind: str
    """NON_FINITE, NORM (far outside the link's running statistics) or LOSS (a local loss)."""
    norm: float
    """The tensor's norm (or the loss)."""
    detail: str = ""

    @property
    def counts(self) -> bool:
        """Whether it counts towards the sender's quarantine (a local loss does not)."""
        return self.kind != LOSS

    def describe(self) -> str:
        what = {"forward": "activation", "backward": "activation-gradient"}.get(self.direction, "loss")
        if self.kind == LOSS:
            return f"step {self.step}: this stage's loss of micro-batch {self.micro_batch} ({self.norm:.4g}) {self.detail}"
        return (f"step {self.step}: the {what} of micro-batch {self.micro_batch} from {self.sender} was rejected: "
                f"norm {self.norm:.4g} {self.detail}")


@dataclass
class Door:
    """One stage replica's checks of what it receives and computes; its offences until the stage takes them."""

    node_id: str
    config: DoorConfig = field(default_factory=DoorConfig)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._gauges: dict[tuple[str, str], NormGauge] = {}
        self._last: dict[tuple[str, str], torch.Tensor] = {}
        self._loss = NormGauge()
        self._offences: list[Offence] = []
        self.rejected = 0
        """Tensors rejected by this door since it was made."""

    def admit(self, key: TensorKey, sender: str, tensor: torch.Tensor, norm: float | None = None) -> torch.Tensor:
        """`tensor` (received under `key` from `sender`, of norm `norm` when measured at decode) if it passes, else
        the stand-in the stage computes with, with the offence recorded for `take`."""
        if norm is None:
            norm = tensor_norm(tensor)
        link = (sender, key.direction)
        cfg = self.config
        with self._lock:
            gauge = self._gauges.setdefault(link, NormGauge())
            offence = None
            if not math.isfinite(norm):
                offence = Offence(sender=sender, step=key.step, micro_batch=key.micro_batch, direction=key.direction,
                                  kind=NON_FINITE, norm=norm, detail="(non-finite values)")
            else:
                log_norm = math.log(max(norm, 1e-30))
                if gauge.outside(log_norm, cfg, cfg.warmup):
                    low, high = gauge.expected(cfg)
                    offence = Offence(sender=sender, step=key.step, micro_batch=key.micro_batch,
                                      direction=key.direction, kind=NORM, norm=norm,
                                      detail=f"(outside the link's band [{low:.3g}, {high:.3g}] after {gauge.seen} "
                                             f"tensors)")
                else:
                    gauge.add(log_norm, cfg)
                    self._last[link] = tensor
                    return tensor
            self._offences.append(offence)
            self.rejected += 1
            last = self._last.get(link)
        if last is not None and last.shape == tensor.shape and last.dtype == tensor.dtype:
            return last.detach().clone()
        return torch.zeros_like(tensor)

    def check_loss(self, step: int, loss: float, micro_batch: int = 0) -> Offence | None:
        """Judge a last stage's loss of one micro-batch of `step`; the offence (also kept for `take`) or None."""
        cfg = self.config
        with self._lock:
            offence = None
            if not math.isfinite(loss):
                offence = Offence(sender=self.node_id, step=step, micro_batch=micro_batch, direction="loss", kind=LOSS,
                                  norm=loss, detail="is not finite")
            elif loss > 0:
                log_loss = math.log(loss)
                if self._loss.seen >= cfg.loss_warmup and log_loss > self._loss.mean + math.log(cfg.loss_spike):
                    offence = Offence(sender=self.node_id, step=step, micro_batch=micro_batch, direction="loss", kind=LOSS,
                                      norm=loss, detail=f"spiked past {cfg.loss_spike:g}x its running mean "
                                                        f"{math.exp(self._loss.mean):.4g}")
                else:
                    self._loss.add(log_loss, cfg)
            if offence is not None:
                self._offences.append(offence)
            return offence

    def take(self, step: int) -> list[Offence]:
        """The offences of `step` (and of any older step not taken), oldest first; kept no longer."""
        with self._lock:
            out = [o for o in self._offences if o.step <= step]
            self._offences = [o for o in self._offences if o.step > step]
            return out
