"""The job spec: what to train, on what data, how, and when to start.

Written in TOML (see examples/tiny.toml); the coordinator loads it, validates it and hands its text to
every node in `JoinReply.job.spec_toml`, so nodes and coordinator read the same spec. Sections:

    [job]         name, id (optional: derived from the name and the spec's content)
    [model]       preset = "tiny" | "llama-3.2-1b" | ..., or hf_config = "path/config.json" (a Hugging Face
                  config, atoll.hf), and/or explicit atoll.modelspec.ModelConfig fields (override either);
                  pretrained = "dir" (safetensors read by each node; its config.json gives the shape when
                  nothing else does)
    [data]        source = "builtin" | a text, JSONL or Parquet file, a folder of them or a datasets folder
                  (read by each node), tokenizer = "bytes" | "path/tokenizer.json", format, field,
                  validation_fraction | validation (a held-out source)
    [train]       global_batch, seq_len, micro_batch, steps, lr, weight_decay, warmup, grad_clip,
                  precision ("fp32" | "bf16" | "fp16"; also spelt dtype), loss_scale, loss_scale_window (fp16),
                  seed, schedule ("1f1b" | "gpipe"), zero_bubble (true | false), tensorboard_dir, eval_every,
                  eval_batches
    [checkpoint]  interval (steps between checkpoints; 0: none), keep (complete checkpoints kept; 0: all),
                  replicas (other nodes that take a copy of each checkpoint; default 1)
    [compression] mode ("adaptive" | "wan" | "identity" | a codec name), rank (lowrank), bits (hadamard)
    [cluster]     expected_nodes (plan once this many have joined), min_nodes (fewest to keep training),
                  host_tp (true: tensor parallelism over the nodes that share a machine)

Every error names the field (`train.micro_batch`) and says what to change. Numbers are bounded where a real job
never goes (`MAX_STEPS` and the others below, `atoll.modelspec.SIZE_LIMITS` for the model), so that what the spec
asks for fits the wire's integers and torch's, and every float is finite.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from atoll.fsutil import read_text_file
from atoll.models import preset
from atoll.modelspec import SIZE_LIMITS, ModelConfig, ModelSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CODECS = ("identity", "fp16", "bf16", "int8", "int4", "topk", "hadamard", "lowrank")
COMPRESSION_MODES = ("adaptive", "wan", *CODECS)
DATA_FORMATS = ("auto", "text", "jsonl", "parquet", "datasets")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

MAX_STEPS = 10**12
"""The most steps a spec's step count may name (train.steps, warmup, eval_every, loss_scale_window,
checkpoint.interval and keep): far beyond any real job, well inside the 64-bit step counters of the wire."""
MAX_GLOBAL_BATCH = 2**24
"""The most sequences per optimizer step (train.global_batch, so micro_batch too; `atoll plan --global-batch`):
16,777,216, thousands of times any published run's batch, so a larger one is a typo, refused before a planner lays
out that many micro-batches (the plan sends both as 32-bit integers)."""
MAX_TOKENS = 2**63 - 1
"""The most tokens a job may train (train.steps x global_batch x seq_len): nodes and the coordinator count them
in 64-bit integers."""
MAX_SEED = 2**40 - 1
"""The largest train.seed: nodes seed torch generators with seed x 1,000,003 plus an index (a layer, a step, a
held-out batch past 2**62), which must fit a signed 64-bit integer."""
MAX_NODES = 1_000_000
"""The most nodes (one a GPU) cluster.expected_nodes and checkpoint.replicas may name."""
MAX_EVAL_BATCHES = 1_000_000
"""The most global batches in one validation pass (train.eval_batches)."""
MAX_ROUND_STEPS = 10**9
"""The most inner steps of an outer round (outer.inner_steps, apply_after): the plan sends them as 32-bit
integers."""
MAX_LOSS_SCALE = 2.0**64
"""The largest fp16 loss scale (train.loss_scale): scales in use are near 2**16, and torch keeps it in fp32."""
MAX_DEADLINE_SECONDS = 10**7
"""The longest outer.deadline_seconds (about 116 days)."""


TOKEN_ENV = "ATOLL_TOKEN"
"""Environment variable that may hold the job token (a secret, so not part of the spec)."""


def resolve_token(token: str | None = None, token_file: str | Path | None = None) -> str | None:
    """The job token from a flag, else a file (first line), else $ATOLL_TOKEN; None when none is given."""
    if token:
        logging.getLogger("atoll").warning(
            "--token shows in the process list (ps) to every user of this machine; pass --token-file or "
            "$%s instead", TOKEN_ENV)
        return token
    if token_file:
        path = Path(token_file)
        if path.is_dir():
            raise IsADirectoryError(f"token file {path} is a folder, not a file; pass the file that holds the job "
                                    f"token (runs/coordinator/token in a coordinator's state dir)")
        if not path.is_file():
            raise FileNotFoundError(f"token file {path}: no such file. A coordinator started without --token-file "
                                    f"writes its token into its state dir (runs/coordinator/token by default): copy "
                                    f"that file here, or put a secret of your own on its first line")
        text = read_text_file(path, "token file", "pass the file that holds the job token").strip()
        if not text:
            raise ValueError(f"token file {path} is empty; put the job token on its first line")
        return text
    return os.environ.get(TOKEN_ENV) or None


class JobSpecError(ValueError):
    """The job spec is invalid; the message names the field and what to change."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise JobSpecError(message)


def _check_at_most(section: str, obj: Any, limits: dict[str, tuple[int | float, str]]) -> None:
    """Each named field of `obj` at most its limit; `limits` maps a field to (limit, why a real job never
    meets it)."""
    for name, (limit, why) in limits.items():
        value = getattr(obj, name)
        _check(value <= limit, f"{section}.{name} must be at most {limit:,} ({why}), got {value}")


def _check_finite(section: str, obj: Any) -> None:
    """Every float field of `obj` finite: TOML reads inf and nan, which no field takes."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        _check(not isinstance(value, float) or math.isfinite(value),
               f"{section}.{f.name} must be a finite number, got {value}")


_NEVER = "far beyond any real job"


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where the training text comes from."""

    source: str = "builtin"
    """"builtin" (the demo corpus shipped with atoll, sampled in random windows), or a UTF-8 text file, a JSONL
    file, a Parquet file, a folder of them or a `datasets.save_to_disk` folder (streamed and packed; see
    atoll.node.datasets), read by each node from its own disk."""
    tokenizer: str = "bytes"
    """"bytes": one token per byte (vocabulary 256); or the path of a Hugging Face tokenizer.json (see
    `atoll tokenizer train`), whose vocabulary must fit model.vocab_size."""
    format: str = "auto"
    """"auto" (from the source's name), "text", "jsonl", "parquet" or "datasets"."""
    field: str = "text"
    """The JSONL key, Parquet or `datasets` column holding each row's text."""
    validation_fraction: float = 0.0
    """Share of the source held out for validation (rows of a streamed source, the tail of "builtin")."""
    validation: str = ""
    """A separate held-out source (same kinds as `source`); "": none, or `validation_fraction` of `source`."""
    shuffle: bool = True
    """Train on a streamed source's samples in a seeded order (train.seed) rather than in source order: each
    window of `shuffle_window` consecutive samples is read in a permutation of its own, so neighbouring rows of a
    corpus (a file's documents, often sorted by source or date) do not fill the same steps. On by default, as
    training expects batches that are not ordered by the corpus. The order is a function of (seed, step) alone:
    every data-parallel replica reads disjoint samples and a resumed job continues with exactly the batches an
    uninterrupted one reads (`atoll.node.datasets`). The "builtin" corpus is sampled in random windows anyway;
    false does not apply there. Held-out batches stay in source order."""
    shuffle_window: int = 1024
    """Samples per shuffled window: the reach of the shuffle, and what a node holds at once (window x seq_len
    tokens, 16 MB at seq_len 2048). A corpus ordered at a larger scale than this is shuffled at the source."""

    def __post_init__(self) -> None:
        _check_finite("data", self)
        _check(bool(self.source.strip()), 'data.source is empty: use "builtin" or the path of a text file')
        _check(self.tokenizer == "bytes" or self.tokenizer.endswith(".json"),
               f'data.tokenizer must be "bytes" or the path of a tokenizer.json, got {self.tokenizer!r}')
        _check(self.format in DATA_FORMATS,
               f"data.format must be one of {', '.join(DATA_FORMATS)}, got {self.format!r}")
        _check(bool(self.field.strip()), 'data.field is empty: name the JSONL key or column holding the text')
        _check(0 <= self.validation_fraction < 1,
               f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}")
        _check(not (self.validation and self.validation_fraction),
               "set data.validation (a separate held-out source) or data.validation_fraction, not both")
        _check(self.format in ("auto", "text") or self.source != "builtin",
               f'data.format = "{self.format}" does not fit data.source = "builtin" (a text corpus)')
        _check(isinstance(self.shuffle_window, int) and not isinstance(self.shuffle_window, bool)
               and 1 <= self.shuffle_window <= 1 << 24,
               f"data.shuffle_window must be an integer from 1 to {1 << 24:,} samples, got {self.shuffle_window!r}")
        default_window = self.shuffle_window == DataSpec.shuffle_window
        _check(self.source != "builtin" or (self.shuffle and default_window),
               'data.shuffle and data.shuffle_window do not apply to data.source = "builtin" (sampled in random '
               "windows at every step): remove them, or give a streamed source")
        _check(self.shuffle or default_window,
               "data.shuffle_window applies when data.shuffle is true: remove it, or set data.shuffle = true")

    @property
    def has_validation(self) -> bool:
        return bool(self.validation) or self.validation_fraction > 0


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """The optimisation: batch shape, length, optimizer and schedule."""

    global_batch: int
    """Sequences per optimizer step, over all pipelines."""
    seq_len: int
    """Tokens per sequence; at most the model's seq_len."""
    micro_batch: int
    """Sequences one stage replica runs per micro-batch (a pipeline micro-batch is this times the stage's
    data-parallel degree); must divide global_batch."""
    steps: int
    """Optimizer steps to train."""
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    warmup: int = 0
    """Steps of linear learning-rate warm-up."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    dtype: str = "fp32"
    """Precision, written `precision` (or `dtype`) in the TOML: "fp32", "bf16" (autocast) or "fp16" (autocast
    with dynamic loss scaling); weights, gradients and optimizer states stay fp32 (atoll.node.precision)."""
    seed: int = 0
    """Seed of the initial weights and the data order."""
    schedule: str = "1f1b"
    """Pipeline schedule: "1f1b" or "gpipe"."""
    zero_bubble: bool = True
    """Let the planner defer the linear layers' weight gradients of the stages where that fits (each backward
    first computes what the previous stage waits for, and the weight gradients fill the pipeline's idle time),
    and fill a stage's wait for its first gradient with extra warm-up forwards where memory holds them and the
    step is shorter; false: plain 1F1B (every stage computes them in backward, and warms up only as deep as a
    slow link asks)."""
    eval_every: int = 0
    """Steps between validation passes over held-out data (0: none; needs data.validation_fraction or
    data.validation); a pass also runs after the last step."""
    eval_batches: int = 2
    """Global batches of held-out data per validation pass (the same batches every time)."""
    loss_scale: float = 65536.0
    """fp16: the initial loss scale (halved at every overflow, doubled after loss_scale_window good steps)."""
    loss_scale_window: int = 2000
    """fp16: good steps in a row after which the loss scale doubles."""
    tensorboard_dir: str = ""
    """Where nodes write TensorBoard event files (one folder per node); "": none (`atoll node --tensorboard`
    overrides it per machine)."""

    def __post_init__(self) -> None:
        _check_finite("train", self)
        for name in ("global_batch", "seq_len", "micro_batch", "steps"):
            _check(getattr(self, name) > 0, f"train.{name} must be positive, got {getattr(self, name)}")
        _check_at_most("train", self, {
            "steps": (MAX_STEPS, _NEVER), "global_batch": (MAX_GLOBAL_BATCH, _NEVER),
            "seq_len": (SIZE_LIMITS["seq_len"], "the longest model.seq_len"),
            "eval_every": (MAX_STEPS, _NEVER), "eval_batches": (MAX_EVAL_BATCHES, _NEVER),
            "loss_scale_window": (MAX_STEPS, _NEVER)})
        _check(self.steps * self.global_batch * self.seq_len <= MAX_TOKENS,
               f"train.steps x train.global_batch x train.seq_len (the tokens the job trains) must be at most "
               f"{MAX_TOKENS:,} (they are counted in 64-bit integers), got "
               f"{self.steps * self.global_batch * self.seq_len:,}; lower train.steps")
        _check(self.global_batch % self.micro_batch == 0,
               f"train.micro_batch ({self.micro_batch}) must divide train.global_batch ({self.global_batch})")
        _check(self.lr > 0, f"train.lr must be positive, got {self.lr}")
        _check(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _check(0 <= self.warmup <= self.steps, f"train.warmup must be between 0 and train.steps ({self.steps}), "
               f"got {self.warmup}")
        _check(self.grad_clip >= 0, f"train.grad_clip must be >= 0 (0: no clipping), got {self.grad_clip}")
        _check(self.dtype in ("fp32", "bf16", "fp16"),
               f'train.precision (train.dtype) must be "fp32", "bf16" or "fp16", got {self.dtype!r}')
        _check(0 < self.loss_scale <= MAX_LOSS_SCALE,
               f"train.loss_scale must be a positive number at most 2**64 (scales in use are near 2**16), "
               f"got {self.loss_scale}")
        _check(self.loss_scale_window >= 1, f"train.loss_scale_window must be >= 1, got {self.loss_scale_window}")
        _check(0 <= self.seed <= MAX_SEED,
               f"train.seed must be between 0 and 2**40 - 1 ({MAX_SEED:,}): nodes seed torch generators with "
               f"seed x 1,000,003 + an index, which must fit a signed 64-bit integer; got {self.seed}")
        _check(self.eval_every >= 0, f"train.eval_every must be >= 0 (0: no validation), got {self.eval_every}")
        _check(self.eval_batches >= 1, f"train.eval_batches must be >= 1, got {self.eval_batches}")
        _check(self.schedule in ("1f1b", "gpipe"), f'train.schedule must be "1f1b" or "gpipe", got {self.schedule!r}')

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // self.micro_batch


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """When stages save their state."""

    interval: int = 0
    """Steps between checkpoints (0: no checkpoints)."""
    keep: int = 3
    """Newest complete checkpoints a node keeps; older step folders are deleted once the coordinator has
    the newer ones (0: keep all). Written to the spec only when not 3, so older jobs keep their ids."""
    replicas: int = 1
    """Other nodes that take a copy of each stage's checkpoint (checkpoint folders are local to each node; a
    node of another region is chosen first). 0: only the writer holds it. Written to the spec only when not 1."""

    def __post_init__(self) -> None:
        _check(self.interval >= 0, f"checkpoint.interval must be >= 0 (0: none), got {self.interval}")
        _check(self.keep >= 0, f"checkpoint.keep must be >= 0 (0: keep all), got {self.keep}")
        _check(self.replicas >= 0, f"checkpoint.replicas must be >= 0 (0: no copies), got {self.replicas}")
        _check_at_most("checkpoint", self, {"interval": (MAX_STEPS, _NEVER), "keep": (MAX_STEPS, _NEVER),
                                            "replicas": (MAX_NODES, _NEVER)})


@dataclass(frozen=True, kw_only=True)
class CompressionSpec:
    """How activations are compressed between stages."""

    mode: str = "adaptive"
    """"adaptive" (a codec per link from its measured bandwidth), "wan" (likewise, among the wide-area codecs,
    the least measured loss cost that hides behind compute: `atoll.compression.losscost`), "identity", or one
    codec for every link."""
    rank: int = 16
    """lowrank: rank of the factors sent (16: 42x of float32 at 1,024 tokens x 512, 70x at 2,048 x 768)."""
    bits: int = 4
    """hadamard: bits per code, 2 to 4 (4: 7.5x of float32); lowrank: bits per factor entry, 4, 8 or 16
    (bfloat16)."""

    def __post_init__(self) -> None:
        _check(self.mode in COMPRESSION_MODES,
               f"compression.mode must be one of {', '.join(COMPRESSION_MODES)}, got {self.mode!r}")
        _check(1 <= self.rank <= 4096, f"compression.rank must be in [1, 4096], got {self.rank}")
        _check(self.bits in (2, 3, 4, 8, 16), f"compression.bits must be 2, 3 or 4 (hadamard), or 4, 8 or 16 "
                                              f"(lowrank), got {self.bits}")
        _check(self.mode != "lowrank" or self.bits in (4, 8, 16),
               f"compression.bits of lowrank must be 4, 8 or 16 (bfloat16 factors), got {self.bits}")
        _check(self.mode != "hadamard" or self.bits <= 4,
               f"compression.bits of hadamard must be 2, 3 or 4, got {self.bits}")


OUTER_MODES = ("auto", "sync", "outer")
OUTER_CODECS = ("auto", "identity", "fp16", "bf16", "int8", "int4", "topk", "sparse2")


@dataclass(frozen=True, kw_only=True)
class OuterSpec:
    """Training across regions: replica groups that train apart and sync every round (the DiLoCo family).

    Each replica group (normally a region) trains a whole model replica on its own data shard; every round
    of `inner_steps` steps the groups exchange compressed pseudo-gradients (parameters at the round's start
    minus now), average them weighted by the tokens each trained, and apply the outer optimizer.
    """

    mode: str = "auto"
    """"auto": the planner compares a synchronous plan with replica groups and picks the faster; "sync":
    one synchronous plan over every region; "outer": replica groups whenever the cluster spans regions."""
    inner_steps: int = 0
    """Inner steps per outer round (H) of the fastest group; 0: the smallest H whose sync hides behind a round."""
    lr: float = 1.0
    """Outer learning rate (1.0 with momentum 0: plain averaging of the groups' parameters)."""
    momentum: float = 0.0
    """Outer momentum (DiLoCo: 0.9 with Nesterov and lr 0.7)."""
    nesterov: bool = True
    """Nesterov momentum (when momentum > 0)."""
    codec: str = "auto"
    """Codec of the pseudo-gradients: "auto" picks from the measured WAN bandwidth; or one of int8, int4, sparse2,
    topk, fp16, bf16, identity. Lossy codecs keep an error-feedback residual."""
    topk_fraction: float = 0.02
    """Fraction of elements kept by the top-k codec."""
    sparse_fraction: float = 1 / 64
    """Fraction of each chunk of 4,096 elements the sparse2 codec keeps, at 2 bits a value (SparseLoCo's 1/64:
    about 195x smaller than float32)."""
    overlap: bool = True
    """Exchange round r while round r + 1 trains, applying it at the end of round r + 1 (one round of delay);
    False blocks at each round's end until the exchange lands."""
    apply_after: int = 0
    """With overlap: apply round r's average after this many inner steps of round r + 1 (every node of a group
    at the same step, waiting if it has not landed); 0: as soon as the plan's predicted exchange time allows
    (its steps, plus one); inner_steps or more: at the end of round r + 1."""
    deadline_seconds: float = 0.0
    """How long a round waits for late groups after the first arrives (0: as long as a round lasts, at least
    30 s); a group that misses it is left out of the round."""

    def __post_init__(self) -> None:
        _check_finite("outer", self)
        _check(self.mode in OUTER_MODES, f"outer.mode must be one of {', '.join(OUTER_MODES)}, got {self.mode!r}")
        _check(self.inner_steps >= 0, f"outer.inner_steps must be >= 0 (0: chosen by the planner), got "
                                      f"{self.inner_steps}")
        _check(0 < self.lr <= 2, f"outer.lr must be in (0, 2], got {self.lr}")
        _check(0 <= self.momentum < 1, f"outer.momentum must be in [0, 1), got {self.momentum}")
        _check(self.codec in OUTER_CODECS, f"outer.codec must be one of {', '.join(OUTER_CODECS)}, got {self.codec!r}")
        _check(0 < self.topk_fraction <= 1, f"outer.topk_fraction must be in (0, 1], got {self.topk_fraction}")
        _check(0 < self.sparse_fraction <= 1, f"outer.sparse_fraction must be in (0, 1], got {self.sparse_fraction}")
        _check(self.deadline_seconds >= 0, f"outer.deadline_seconds must be >= 0, got {self.deadline_seconds}")
        _check(self.apply_after >= 0, f"outer.apply_after must be >= 0 (0: chosen from the plan), got {self.apply_after}")
        _check_at_most("outer", self, {"inner_steps": (MAX_ROUND_STEPS, _NEVER), "apply_after": (MAX_ROUND_STEPS, _NEVER),
                                       "deadline_seconds": (MAX_DEADLINE_SECONDS, "about 116 days")})


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """When the coordinator plans."""

    expected_nodes: int = 1
    """Plan once this many nodes have joined (and probed each other)."""
    min_nodes: int = 1
    """Fewest alive nodes to keep planning with after members leave."""
    host_tp: bool = False
    """Let the planner run a stage's layers tensor-parallel over nodes that share a machine (the same hostname:
    one node process per GPU of a multi-GPU machine), up to as many as each machine holds, where its cost model
    says that is faster; off: every stage at tp 1. Synchronous plans only (replica groups across regions run
    tp 1), and tp stages resume from checkpoints after a replan, not from live state."""

    def __post_init__(self) -> None:
        _check(self.expected_nodes >= 1, f"cluster.expected_nodes must be >= 1, got {self.expected_nodes}")
        _check_at_most("cluster", self, {"expected_nodes": (MAX_NODES, _NEVER)})
        _check(1 <= self.min_nodes <= self.expected_nodes,
               f"cluster.min_nodes must be between 1 and cluster.expected_nodes ({self.expected_nodes}), "
               f"got {self.min_nodes}")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One training job, as loaded from its TOML file."""

    name: str
    """Readable job name: letters, digits, '.', '_', '-'."""
    model: ModelConfig
    """The model's shape (a preset with any overrides applied)."""
    train: TrainSpec
    """Batch, length, optimizer and schedule."""
    id: str = ""
    """Job id; empty: derived from the name and a hash of the spec."""
    model_preset: str | None = None
    """The preset the model came from, if any (kept so to_toml writes it back)."""
    pretrained: str | None = None
    """A local folder of Hugging Face safetensors weights (model.safetensors, or shards with their index),
    read by each node at step 0: each stage reads only its own tensors (atoll.node.pretrained)."""
    data: DataSpec = field(default_factory=DataSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    compression: CompressionSpec = field(default_factory=CompressionSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    outer: OuterSpec = field(default_factory=OuterSpec)

    def __post_init__(self) -> None:
        _check(bool(_NAME_RE.match(self.name)),
               f"job.name {self.name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        _check(self.train.seq_len <= self.model.seq_len,
               f"train.seq_len ({self.train.seq_len}) exceeds the model's seq_len ({self.model.seq_len}); lower "
               f"train.seq_len or set model.seq_len")
        if self.data.tokenizer == "bytes":
            _check(self.model.vocab_size >= 256,
                   f"model.vocab_size ({self.model.vocab_size}) is below 256, too small for the bytes tokenizer")
        _check(not self.train.eval_every or self.data.has_validation,
               "train.eval_every needs held-out data: set data.validation_fraction (e.g. 0.01) or data.validation")
        if self.id:
            _check(bool(_NAME_RE.match(self.id)),
                   f"job.id {self.id!r} must be 1-64 letters, digits, '.', '_' or '-'")
        else:
            digest = hashlib.sha256(self._content_toml().encode("utf-8")).hexdigest()[:8]
            object.__setattr__(self, "id", f"{self.name}-{digest}")

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec.from_config(self.model)

    # --- TOML ---------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> "JobSpec":
        path = Path(path)
        text = read_text_file(path, "job spec", "pass a TOML file such as examples/tiny.toml", JobSpecError)
        try:
            return cls.from_toml(text)
        except JobSpecError as e:
            raise JobSpecError(f"{path}: {e}") from None

    @classmethod
    def from_toml(cls, text: str) -> "JobSpec":
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise JobSpecError(f"not valid TOML: {e}") from None
        except ValueError as e:  # an integer of thousands of digits, which Python refuses to read
            raise JobSpecError(f"not readable TOML: {str(e).split(';')[0]}") from None
        known = {"job", "model", "data", "train", "checkpoint", "compression", "cluster", "outer"}
        unknown = sorted(set(doc) - known)
        _check(not unknown, f"unknown section(s) {unknown}; sections: {sorted(known)}")
        for sec, value in doc.items():
            _check(isinstance(value, dict), f"[{sec}] must be a table")

        job = _Section("job", doc.get("job", {}))
        name = job.get("name", str)
        _check(name is not None, 'job.name is missing: add name = "..." under [job]')
        job_id = job.get("id", str) or ""
        job.done()

        model, model_preset, pretrained = _model_from(_Section("model", doc.get("model", {})))

        data = _build(DataSpec, "data", doc.get("data", {}))
        train_sec = doc.get("train")
        _check(train_sec is not None, "[train] is missing: add global_batch, seq_len, micro_batch and steps")
        if isinstance(train_sec, dict) and "precision" in train_sec:  # the documented name of train.dtype
            _check("dtype" not in train_sec, "[train] sets both precision and dtype; keep precision")
            train_sec = {("dtype" if k == "precision" else k): v for k, v in train_sec.items()}
        train = _build(TrainSpec, "train", train_sec, spelt={"dtype": "precision"})
        checkpoint = _build(CheckpointSpec, "checkpoint", doc.get("checkpoint", {}))
        compression = _build(CompressionSpec, "compression", doc.get("compression", {}))
        cluster = _build(ClusterSpec, "cluster", doc.get("cluster", {}))
        outer = _build(OuterSpec, "outer", doc.get("outer", {}))
        try:
            return cls(name=name, id=job_id, model=model, model_preset=model_preset, pretrained=pretrained,
                       data=data, train=train,
                       checkpoint=checkpoint, compression=compression, cluster=cluster, outer=outer)
        except JobSpecError:
            raise
        except ValueError as e:  # ModelConfig's own checks name model.* fields
            raise JobSpecError(str(e)) from None

    def to_toml(self) -> str:
        """The spec as TOML; `from_toml(to_toml())` gives an equal spec (id included)."""
        return f'[job]\nname = {_toml_value(self.name)}\nid = {_toml_value(self.id)}\n\n' + self._content_toml()

    def _content_toml(self) -> str:
        out: list[str] = ["[model]"]
        base = preset(self.model_preset) if self.model_preset else None
        if base is not None:
            out.append(f"preset = {_toml_value(self.model_preset)}")
        if self.pretrained:
            out.append(f"pretrained = {_toml_value(self.pretrained)}")
        for f in fields(ModelConfig):
            value = getattr(self.model, f.name)
            if value is None or (base is not None and getattr(base, f.name) == value):
                continue
            out.append(f"{f.name} = {_toml_value(value)}")
        for sec in ("data", "train", "checkpoint", "compression", "cluster"):
            obj = getattr(self, sec)
            out.append(f"\n[{sec}]")
            out.extend(f"{f.name} = {_toml_value(getattr(obj, f.name))}" for f in fields(obj)
                       if not (sec == "checkpoint" and f.name in ("keep", "replicas") and getattr(obj, f.name) == f.default)
                       and not (sec == "train" and f.name in _TRAIN_WRITTEN_WHEN_SET
                                and getattr(obj, f.name) == f.default)
                       and not (sec == "data" and f.name in _DATA_WRITTEN_WHEN_SET
                                and getattr(obj, f.name) == f.default)
                       and not (sec == "cluster" and f.name == "host_tp" and getattr(obj, f.name) == f.default)
                       and not (sec == "compression" and f.name in ("rank", "bits")
                                and getattr(obj, f.name) == f.default))
        if self.outer != OuterSpec():  # written only when set, so jobs without it keep their ids
            out.append("\n[outer]")
            out.extend(f"{f.name} = {_toml_value(getattr(self.outer, f.name))}" for f in fields(self.outer))
        return "\n".join(out) + "\n"

    def with_id(self, job_id: str) -> "JobSpec":
        return replace(self, id=job_id)


_TRAIN_WRITTEN_WHEN_SET = ("loss_scale", "loss_scale_window", "tensorboard_dir", "eval_every", "eval_batches",
                           "zero_bubble")
_DATA_WRITTEN_WHEN_SET = ("format", "field", "validation_fraction", "validation", "shuffle", "shuffle_window")
"""[train] fields written only when they differ from their defaults, so jobs without them keep their ids."""


class _Section:
    """Typed reads from one TOML table, remembering which keys were used."""

    def __init__(self, name: str, table: dict[str, Any]):
        self.name, self.table, self.used = name, table, set[str]()

    def get(self, key: str, kind: type) -> Any:
        self.used.add(key)
        if key not in self.table:
            return None
        value = self.table[key]
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        _check(ok, f"{self.name}.{key} must be {_KIND_NAMES.get(kind, kind.__name__)}, got {value!r}")
        return value

    def done(self, known: list[str] | None = None) -> None:
        unknown = sorted(set(self.table) - self.used)
        _check(not unknown, f"unknown field(s) {unknown} in [{self.name}]; fields: {sorted(known or self.used)}")


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "an array"}


def _field_kind(annotation: Any) -> type:
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str), ("Style", str),
                       ("tuple", list)):
        if text.startswith(name):
            return kind
    raise TypeError(f"no TOML kind for {annotation!r}")  # pragma: no cover - a programming error


def _build(cls: Any, name: str, table: dict[str, Any], spelt: dict[str, str] | None = None) -> Any:
    """`cls` from a TOML table; `spelt` maps a field to the name the docs and examples write it as (an error
    lists that name)."""
    sec = _Section(name, table)
    kwargs = {}
    for f in fields(cls):
        value = sec.get(f.name, _field_kind(f.type))
        if value is not None:
            kwargs[f.name] = value
    spelt = spelt or {}
    sec.done(sorted(f"{spelt[f.name]} (or {f.name})" if f.name in spelt else f.name for f in fields(cls)))
    missing = [f.name for f in fields(cls)
               if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
    _check(not missing, f"[{name}] is missing {', '.join(f'{name}.{m}' for m in missing)}")
    return cls(**kwargs)


def _model_from(sec: _Section) -> tuple[ModelConfig, str | None, str | None]:
    """(model, preset name, pretrained folder). A hf_config (or, alone, the pretrained folder's config.json)
    is resolved into explicit fields here, so the spec nodes receive does not need the file."""
    from atoll.hf import config_from_file

    preset_name = sec.get("preset", str)
    hf_path = sec.get("hf_config", str)
    pretrained = sec.get("pretrained", str) or None
    _check(not (preset_name and hf_path), "[model] has both preset and hf_config: keep one")
    overrides: dict[str, Any] = {}
    for f in fields(ModelConfig):
        value = sec.get(f.name, _field_kind(f.type))
        if value is not None:
            overrides[f.name] = value
    sec.done()
    try:
        if preset_name is not None:
            base = preset(preset_name)
            return replace(base, **overrides), preset_name.lower(), pretrained
        required = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
        if hf_path or (pretrained and not all(r in overrides for r in required)):
            try:
                base = config_from_file(hf_path or pretrained)
            except (OSError, ValueError) as e:  # missing, a folder, not UTF-8 or JSON, a field of the wrong type
                raise JobSpecError(f"model.{'hf_config' if hf_path else 'pretrained'}: {e}") from None
            return replace(base, **overrides), None, pretrained
        required = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")
        missing = [f"model.{r}" for r in required if r not in overrides]
        _check(not missing, f"[model] needs preset = \"tiny\" (or another preset) or explicit fields; missing "
               f"{', '.join(missing)}")
        return ModelConfig(**overrides), None, pretrained
    except JobSpecError:
        raise
    except ValueError as e:
        raise JobSpecError(str(e)) from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")  # pragma: no cover
