from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_IDENTITY: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8_BLOCK: _ClassVar[Codec]
    CODEC_INT4_BLOCK: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_SPARSE2: _ClassVar[Codec]
    CODEC_HADAMARD: _ClassVar[Codec]
    CODEC_LOWRANK: _ClassVar[Codec]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]

class Direction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTION_UNSPECIFIED: _ClassVar[Direction]
    DIRECTION_FORWARD: _ClassVar[Direction]
    DIRECTION_BACKWARD: _ClassVar[Direction]
    DIRECTION_OUTER: _ClassVar[Direction]
CODEC_IDENTITY: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8_BLOCK: Codec
CODEC_INT4_BLOCK: Codec
CODEC_TOPK: Codec
CODEC_SPARSE2: Codec
CODEC_HADAMARD: Codec
CODEC_LOWRANK: Codec
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DIRECTION_UNSPECIFIED: Direction
DIRECTION_FORWARD: Direction
DIRECTION_BACKWARD: Direction
DIRECTION_OUTER: Direction

class CodecParams(_message.Message):
    __slots__ = ("block_size", "topk_fraction", "zstd_level", "bits", "rank", "seed")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOPK_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ZSTD_LEVEL_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    topk_fraction: float
    zstd_level: int
    bits: int
    rank: int
    seed: int
    def __init__(self, block_size: _Optional[int] = ..., topk_fraction: _Optional[float] = ..., zstd_level: _Optional[int] = ..., bits: _Optional[int] = ..., rank: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "step", "micro_batch", "direction", "name", "shape", "dtype", "codec", "codec_params", "total_bytes", "checksum", "sender", "pipeline", "stage", "replica")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    step: int
    micro_batch: int
    direction: Direction
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec: Codec
    codec_params: CodecParams
    total_bytes: int
    checksum: int
    sender: str
    pipeline: int
    stage: int
    replica: int
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., direction: _Optional[_Union[Direction, str]] = ..., name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., codec_params: _Optional[_Union[CodecParams, _Mapping]] = ..., total_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., sender: _Optional[str] = ..., pipeline: _Optional[int] = ..., stage: _Optional[int] = ..., replica: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("meta", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    data: bytes
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("tensors", "bytes", "receive_seconds")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tensors: int
    bytes: int
    receive_seconds: float
    def __init__(self, tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., receive_seconds: _Optional[float] = ...) -> None: ...

class LayerTiming(_message.Message):
    __slots__ = ("layer_kind", "micro_batch", "seq_len", "forward_seconds", "backward_seconds", "weight_fraction", "split_overhead")
    LAYER_KIND_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    layer_kind: str
    micro_batch: int
    seq_len: int
    forward_seconds: float
    backward_seconds: float
    weight_fraction: float
    split_overhead: float
    def __init__(self, layer_kind: _Optional[str] = ..., micro_batch: _Optional[int] = ..., seq_len: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., weight_fraction: _Optional[float] = ..., split_overhead: _Optional[float] = ...) -> None: ...

class NodeProfile(_message.Message):
    __slots__ = ("hostname", "device_kind", "device_name", "device_count", "memory_total_bytes", "memory_free_bytes", "cpu_count", "layer_timings", "optimizer_step_seconds", "torch_version", "atoll_version", "region", "unreachable")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATOLL_VERSION_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    device_kind: str
    device_name: str
    device_count: int
    memory_total_bytes: int
    memory_free_bytes: int
    cpu_count: int
    layer_timings: _containers.RepeatedCompositeFieldContainer[LayerTiming]
    optimizer_step_seconds: float
    torch_version: str
    atoll_version: str
    region: str
    unreachable: bool
    def __init__(self, hostname: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., device_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., cpu_count: _Optional[int] = ..., layer_timings: _Optional[_Iterable[_Union[LayerTiming, _Mapping]]] = ..., optimizer_step_seconds: _Optional[float] = ..., torch_version: _Optional[str] = ..., atoll_version: _Optional[str] = ..., region: _Optional[str] = ..., unreachable: _Optional[bool] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("src", "dst", "bandwidth_bytes_per_s", "rtt_seconds", "probe_bytes", "measured_unix", "flows")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    bandwidth_bytes_per_s: float
    rtt_seconds: float
    probe_bytes: int
    measured_unix: float
    flows: int
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., rtt_seconds: _Optional[float] = ..., probe_bytes: _Optional[int] = ..., measured_unix: _Optional[float] = ..., flows: _Optional[int] = ...) -> None: ...

class Island(_message.Message):
    __slots__ = ("id", "device_name", "node_ids", "inner_bandwidth_bytes_per_s", "outer_bandwidth_bytes_per_s", "group", "gpus")
    ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    INNER_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    OUTER_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    id: str
    device_name: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    inner_bandwidth_bytes_per_s: float
    outer_bandwidth_bytes_per_s: float
    group: str
    gpus: int
    def __init__(self, id: _Optional[str] = ..., device_name: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., inner_bandwidth_bytes_per_s: _Optional[float] = ..., outer_bandwidth_bytes_per_s: _Optional[float] = ..., group: _Optional[str] = ..., gpus: _Optional[int] = ...) -> None: ...

class LinkPlan(_message.Message):
    __slots__ = ("codec", "codec_params", "bytes", "seconds", "backward_seconds", "latency_seconds")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    codec_params: CodecParams
    bytes: int
    seconds: float
    backward_seconds: float
    latency_seconds: float
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., codec_params: _Optional[_Union[CodecParams, _Mapping]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., latency_seconds: _Optional[float] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("forward_seconds", "backward_seconds", "sync_seconds", "sync_hidden_seconds", "optimizer_seconds", "weight_seconds", "split_seconds")
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_HIDDEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    forward_seconds: float
    backward_seconds: float
    sync_seconds: float
    sync_hidden_seconds: float
    optimizer_seconds: float
    weight_seconds: float
    split_seconds: float
    def __init__(self, forward_seconds: _Optional[float] = ..., backward_seconds: _Optional[float] = ..., sync_seconds: _Optional[float] = ..., sync_hidden_seconds: _Optional[float] = ..., optimizer_seconds: _Optional[float] = ..., weight_seconds: _Optional[float] = ..., split_seconds: _Optional[float] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("index", "island", "node_ids", "layer_start", "layer_end", "dp", "tp", "zero", "recompute", "compute_seconds", "memory_bytes_per_device", "send", "dp_rendezvous", "recompute_layers", "in_flight", "defer_weights", "defer_layers", "lanes", "timing")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    DP_RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DEFER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEFER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    index: int
    island: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    layer_start: int
    layer_end: int
    dp: int
    tp: int
    zero: int
    recompute: bool
    compute_seconds: float
    memory_bytes_per_device: float
    send: LinkPlan
    dp_rendezvous: str
    recompute_layers: _containers.RepeatedScalarFieldContainer[int]
    in_flight: int
    defer_weights: int
    defer_layers: _containers.RepeatedScalarFieldContainer[int]
    lanes: int
    timing: StageTiming
    def __init__(self, index: _Optional[int] = ..., island: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dp: _Optional[int] = ..., tp: _Optional[int] = ..., zero: _Optional[int] = ..., recompute: _Optional[bool] = ..., compute_seconds: _Optional[float] = ..., memory_bytes_per_device: _Optional[float] = ..., send: _Optional[_Union[LinkPlan, _Mapping]] = ..., dp_rendezvous: _Optional[str] = ..., recompute_layers: _Optional[_Iterable[int]] = ..., in_flight: _Optional[int] = ..., defer_weights: _Optional[int] = ..., defer_layers: _Optional[_Iterable[int]] = ..., lanes: _Optional[int] = ..., timing: _Optional[_Union[StageTiming, _Mapping]] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("index", "micro_batch", "num_micro_batches", "stages")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    index: int
    micro_batch: int
    num_micro_batches: int
    stages: _containers.RepeatedCompositeFieldContainer[Stage]
    def __init__(self, index: _Optional[int] = ..., micro_batch: _Optional[int] = ..., num_micro_batches: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[Stage, _Mapping]]] = ...) -> None: ...

class PlanPrediction(_message.Message):
    __slots__ = ("step_time_seconds", "tokens_per_second", "mfu", "bottleneck")
    STEP_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    step_time_seconds: float
    tokens_per_second: float
    mfu: float
    bottleneck: str
    def __init__(self, step_time_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., mfu: _Optional[float] = ..., bottleneck: _Optional[str] = ...) -> None: ...

class ReplicaGroup(_message.Message):
    __slots__ = ("name", "pipelines", "inner_steps", "step_time_seconds", "tokens_per_second", "since_epoch", "round")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SINCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    name: str
    pipelines: _containers.RepeatedScalarFieldContainer[int]
    inner_steps: int
    step_time_seconds: float
    tokens_per_second: float
    since_epoch: int
    round: int
    def __init__(self, name: _Optional[str] = ..., pipelines: _Optional[_Iterable[int]] = ..., inner_steps: _Optional[int] = ..., step_time_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., since_epoch: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class OuterPlan(_message.Message):
    __slots__ = ("inner_steps", "codec", "codec_params", "lr", "momentum", "nesterov", "overlap", "deadline_seconds", "sync_seconds", "round_seconds", "bytes_per_round", "reason")
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    inner_steps: int
    codec: Codec
    codec_params: CodecParams
    lr: float
    momentum: float
    nesterov: bool
    overlap: bool
    deadline_seconds: float
    sync_seconds: float
    round_seconds: float
    bytes_per_round: int
    reason: str
    def __init__(self, inner_steps: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., codec_params: _Optional[_Union[CodecParams, _Mapping]] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., overlap: _Optional[bool] = ..., deadline_seconds: _Optional[float] = ..., sync_seconds: _Optional[float] = ..., round_seconds: _Optional[float] = ..., bytes_per_round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("epoch", "job_id", "model", "global_batch", "seq_len", "predicted", "islands", "pipelines", "created_unix", "resume_step", "node_addresses", "rendezvous", "mode", "groups", "outer", "idle", "relays", "checkpoint_copies", "handover", "reached_step", "mode_reason", "checkpoint_resume")
    class NodeAddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class HandoverEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    OUTER_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_COPIES_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    REACHED_STEP_FIELD_NUMBER: _ClassVar[int]
    MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_RESUME_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    job_id: str
    model: str
    global_batch: int
    seq_len: int
    predicted: PlanPrediction
    islands: _containers.RepeatedCompositeFieldContainer[Island]
    pipelines: _containers.RepeatedCompositeFieldContainer[Pipeline]
    created_unix: float
    resume_step: int
    node_addresses: _containers.ScalarMap[str, str]
    rendezvous: str
    mode: str
    groups: _containers.RepeatedCompositeFieldContainer[ReplicaGroup]
    outer: OuterPlan
    idle: _containers.RepeatedCompositeFieldContainer[IdleDevices]
    relays: _containers.RepeatedCompositeFieldContainer[RelayRoute]
    checkpoint_copies: _containers.RepeatedCompositeFieldContainer[CheckpointCopy]
    handover: _containers.ScalarMap[str, str]
    reached_step: int
    mode_reason: str
    checkpoint_resume: bool
    def __init__(self, epoch: _Optional[int] = ..., job_id: _Optional[str] = ..., model: _Optional[str] = ..., global_batch: _Optional[int] = ..., seq_len: _Optional[int] = ..., predicted: _Optional[_Union[PlanPrediction, _Mapping]] = ..., islands: _Optional[_Iterable[_Union[Island, _Mapping]]] = ..., pipelines: _Optional[_Iterable[_Union[Pipeline, _Mapping]]] = ..., created_unix: _Optional[float] = ..., resume_step: _Optional[int] = ..., node_addresses: _Optional[_Mapping[str, str]] = ..., rendezvous: _Optional[str] = ..., mode: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[ReplicaGroup, _Mapping]]] = ..., outer: _Optional[_Union[OuterPlan, _Mapping]] = ..., idle: _Optional[_Iterable[_Union[IdleDevices, _Mapping]]] = ..., relays: _Optional[_Iterable[_Union[RelayRoute, _Mapping]]] = ..., checkpoint_copies: _Optional[_Iterable[_Union[CheckpointCopy, _Mapping]]] = ..., handover: _Optional[_Mapping[str, str]] = ..., reached_step: _Optional[int] = ..., mode_reason: _Optional[str] = ..., checkpoint_resume: _Optional[bool] = ...) -> None: ...

class CheckpointCopy(_message.Message):
    __slots__ = ("node_id", "layer_start", "layer_end", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    layer_start: int
    layer_end: int
    address: str
    def __init__(self, node_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class RelayRoute(_message.Message):
    __slots__ = ("a", "b", "via", "bandwidth_bytes_per_s")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    via: str
    bandwidth_bytes_per_s: float
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., via: _Optional[str] = ..., bandwidth_bytes_per_s: _Optional[float] = ...) -> None: ...

class IdleDevices(_message.Message):
    __slots__ = ("island", "gpus", "reason", "nodes")
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    island: str
    gpus: int
    reason: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, island: _Optional[str] = ..., gpus: _Optional[int] = ..., reason: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class LinkStats(_message.Message):
    __slots__ = ("peer", "direction", "bytes_raw", "bytes_wire", "seconds", "codec", "bandwidth_bytes_per_s", "transfers")
    PEER_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RAW_FIELD_NUMBER: _ClassVar[int]
    BYTES_WIRE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    direction: Direction
    bytes_raw: int
    bytes_wire: int
    seconds: float
    codec: Codec
    bandwidth_bytes_per_s: float
    transfers: int
    def __init__(self, peer: _Optional[str] = ..., direction: _Optional[_Union[Direction, str]] = ..., bytes_raw: _Optional[int] = ..., bytes_wire: _Optional[int] = ..., seconds: _Optional[float] = ..., codec: _Optional[_Union[Codec, str]] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., transfers: _Optional[int] = ...) -> None: ...

class CollectiveStats(_message.Message):
    __slots__ = ("kind", "bytes", "participants", "seconds", "count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    bytes: int
    participants: int
    seconds: float
    count: int
    def __init__(self, kind: _Optional[str] = ..., bytes: _Optional[int] = ..., participants: _Optional[int] = ..., seconds: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("job_id", "node_id", "plan_epoch", "step", "pipeline", "stage", "has_loss", "loss", "tokens", "step_seconds", "compute_seconds", "wait_seconds", "links", "unix_time", "peak_memory_bytes", "has_val_loss", "val_loss", "loss_scale", "skipped", "restored_from", "restore_bytes", "restore_seconds", "steps_rolled_back", "session", "offences", "collectives")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    RESTORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    OFFENCES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    plan_epoch: int
    step: int
    pipeline: int
    stage: int
    has_loss: bool
    loss: float
    tokens: int
    step_seconds: float
    compute_seconds: float
    wait_seconds: float
    links: _containers.RepeatedCompositeFieldContainer[LinkStats]
    unix_time: float
    peak_memory_bytes: int
    has_val_loss: bool
    val_loss: float
    loss_scale: float
    skipped: bool
    restored_from: str
    restore_bytes: int
    restore_seconds: float
    steps_rolled_back: int
    session: str
    offences: _containers.RepeatedCompositeFieldContainer[TensorOffence]
    collectives: _containers.RepeatedCompositeFieldContainer[CollectiveStats]
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., pipeline: _Optional[int] = ..., stage: _Optional[int] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., links: _Optional[_Iterable[_Union[LinkStats, _Mapping]]] = ..., unix_time: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ..., has_val_loss: _Optional[bool] = ..., val_loss: _Optional[float] = ..., loss_scale: _Optional[float] = ..., skipped: _Optional[bool] = ..., restored_from: _Optional[str] = ..., restore_bytes: _Optional[int] = ..., restore_seconds: _Optional[float] = ..., steps_rolled_back: _Optional[int] = ..., session: _Optional[str] = ..., offences: _Optional[_Iterable[_Union[TensorOffence, _Mapping]]] = ..., collectives: _Optional[_Iterable[_Union[CollectiveStats, _Mapping]]] = ...) -> None: ...

class TensorOffence(_message.Message):
    __slots__ = ("sender", "kind", "direction", "step", "micro_batch", "norm", "finite", "detail")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    FINITE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    sender: str
    kind: str
    direction: str
    step: int
    micro_batch: int
    norm: float
    finite: bool
    detail: str
    def __init__(self, sender: _Optional[str] = ..., kind: _Optional[str] = ..., direction: _Optional[str] = ..., step: _Optional[int] = ..., micro_batch: _Optional[int] = ..., norm: _Optional[float] = ..., finite: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class Offender(_message.Message):
    __slots__ = ("node_id", "offences", "newest", "quarantined", "reason", "since_unix")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFENCES_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    offences: int
    newest: str
    quarantined: bool
    reason: str
    since_unix: float
    def __init__(self, node_id: _Optional[str] = ..., offences: _Optional[int] = ..., newest: _Optional[str] = ..., quarantined: _Optional[bool] = ..., reason: _Optional[str] = ..., since_unix: _Optional[float] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("job_id", "node_id", "plan_epoch", "step", "layer_start", "layer_end", "path", "bytes", "data_position", "copy_of", "session", "checksum", "not_written")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    COPY_OF_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NOT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    plan_epoch: int
    step: int
    layer_start: int
    layer_end: int
    path: str
    bytes: int
    data_position: int
    copy_of: str
    session: str
    checksum: int
    not_written: str
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., data_position: _Optional[int] = ..., copy_of: _Optional[str] = ..., session: _Optional[str] = ..., checksum: _Optional[int] = ..., not_written: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "node_id", "job_id", "profile", "peer_address", "csr_pem", "session")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    token: str
    node_id: str
    job_id: str
    profile: NodeProfile
    peer_address: str
    csr_pem: bytes
    session: str
    def __init__(self, token: _Optional[str] = ..., node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., profile: _Optional[_Union[NodeProfile, _Mapping]] = ..., peer_address: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., session: _Optional[str] = ...) -> None: ...

class JoinChallengeRequest(_message.Message):
    __slots__ = ("token", "node_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    node_id: str
    def __init__(self, token: _Optional[str] = ..., node_id: _Optional[str] = ...) -> None: ...

class JoinChallengeReply(_message.Message):
    __slots__ = ("challenge", "expires_seconds")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_SECONDS_FIELD_NUMBER: _ClassVar[int]
    challenge: str
    expires_seconds: float
    def __init__(self, challenge: _Optional[str] = ..., expires_seconds: _Optional[float] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "name", "spec_toml", "run_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOML_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    spec_toml: str
    run_id: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., spec_toml: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("node_id", "job", "lease_seconds", "heartbeat_interval_seconds", "reachable", "reachability", "certificate_pem", "ca_pem")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job: JobInfo
    lease_seconds: float
    heartbeat_interval_seconds: float
    reachable: bool
    reachability: str
    certificate_pem: bytes
    ca_pem: bytes
    def __init__(self, node_id: _Optional[str] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ..., reachable: _Optional[bool] = ..., reachability: _Optional[str] = ..., certificate_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "plan_epoch", "step", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    plan_epoch: int
    step: int
    session: str
    def __init__(self, node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class ProbeTarget(_message.Message):
    __slots__ = ("node_id", "address", "probe_bytes", "start_unix", "flows")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_FIELD_NUMBER: _ClassVar[int]
    FLOWS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    probe_bytes: int
    start_unix: float
    flows: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., probe_bytes: _Optional[int] = ..., start_unix: _Optional[float] = ..., flows: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease_seconds", "plan_epoch", "probe", "job_finished", "target_steps", "heartbeat_interval_seconds", "coordinator_unix", "prune_checkpoints_before", "keep_checkpoint_step", "quarantined", "quarantine_reason", "write_checkpoints")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_UNIX_FIELD_NUMBER: _ClassVar[int]
    PRUNE_CHECKPOINTS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    WRITE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    plan_epoch: int
    probe: _containers.RepeatedCompositeFieldContainer[ProbeTarget]
    job_finished: bool
    target_steps: int
    heartbeat_interval_seconds: float
    coordinator_unix: float
    prune_checkpoints_before: int
    keep_checkpoint_step: int
    quarantined: bool
    quarantine_reason: str
    write_checkpoints: bool
    def __init__(self, lease_seconds: _Optional[float] = ..., plan_epoch: _Optional[int] = ..., probe: _Optional[_Iterable[_Union[ProbeTarget, _Mapping]]] = ..., job_finished: _Optional[bool] = ..., target_steps: _Optional[int] = ..., heartbeat_interval_seconds: _Optional[float] = ..., coordinator_unix: _Optional[float] = ..., prune_checkpoints_before: _Optional[int] = ..., keep_checkpoint_step: _Optional[int] = ..., quarantined: _Optional[bool] = ..., quarantine_reason: _Optional[str] = ..., write_checkpoints: _Optional[bool] = ...) -> None: ...

class ProbeReport(_message.Message):
    __slots__ = ("node_id", "links")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    def __init__(self, node_id: _Optional[str] = ..., links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class WatchPlanRequest(_message.Message):
    __slots__ = ("node_id", "known_epoch", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    known_epoch: int
    session: str
    def __init__(self, node_id: _Optional[str] = ..., known_epoch: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class PackedPlan(_message.Message):
    __slots__ = ("epoch", "plan_bytes", "plan_zstd")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_ZSTD_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    plan_bytes: int
    plan_zstd: bytes
    def __init__(self, epoch: _Optional[int] = ..., plan_bytes: _Optional[int] = ..., plan_zstd: _Optional[bytes] = ...) -> None: ...

class StepAck(_message.Message):
    __slots__ = ("plan_epoch", "stop", "target_steps")
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    plan_epoch: int
    stop: bool
    target_steps: int
    def __init__(self, plan_epoch: _Optional[int] = ..., stop: _Optional[bool] = ..., target_steps: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id", "reason", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    session: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class RunFailure(_message.Message):
    __slots__ = ("job_id", "node_id", "plan_epoch", "step", "reason", "lost_checkpoint_step", "session")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    plan_epoch: int
    step: int
    reason: str
    lost_checkpoint_step: int
    session: str
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., lost_checkpoint_step: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class OuterSyncRequest(_message.Message):
    __slots__ = ("job_id", "node_id", "plan_epoch", "round", "group", "arrived", "tokens", "inner_step", "sync_bytes", "sync_seconds", "late_seconds", "session", "fetched_version", "unreachable", "version", "anchor_hashes", "step_seconds", "round_steps", "contribution_norm", "has_contribution_norm", "hold_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    SYNC_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FETCHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_HASHES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_NORM_FIELD_NUMBER: _ClassVar[int]
    HAS_CONTRIBUTION_NORM_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    plan_epoch: int
    round: int
    group: int
    arrived: bool
    tokens: int
    inner_step: int
    sync_bytes: int
    sync_seconds: float
    late_seconds: float
    session: str
    fetched_version: int
    unreachable: _containers.RepeatedCompositeFieldContainer[OuterParticipant]
    version: int
    anchor_hashes: _containers.RepeatedCompositeFieldContainer[OuterAnchorHash]
    step_seconds: float
    round_steps: int
    contribution_norm: float
    has_contribution_norm: bool
    hold_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., round: _Optional[int] = ..., group: _Optional[int] = ..., arrived: _Optional[bool] = ..., tokens: _Optional[int] = ..., inner_step: _Optional[int] = ..., sync_bytes: _Optional[int] = ..., sync_seconds: _Optional[float] = ..., late_seconds: _Optional[float] = ..., session: _Optional[str] = ..., fetched_version: _Optional[int] = ..., unreachable: _Optional[_Iterable[_Union[OuterParticipant, _Mapping]]] = ..., version: _Optional[int] = ..., anchor_hashes: _Optional[_Iterable[_Union[OuterAnchorHash, _Mapping]]] = ..., step_seconds: _Optional[float] = ..., round_steps: _Optional[int] = ..., contribution_norm: _Optional[float] = ..., has_contribution_norm: _Optional[bool] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class OuterGroupSteps(_message.Message):
    __slots__ = ("group", "since_epoch", "inner_steps", "step_seconds")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SINCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    since_epoch: int
    inner_steps: int
    step_seconds: float
    def __init__(self, group: _Optional[str] = ..., since_epoch: _Optional[int] = ..., inner_steps: _Optional[int] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class OuterAnchorHash(_message.Message):
    __slots__ = ("round", "layer", "crc32")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    round: int
    layer: int
    crc32: int
    def __init__(self, round: _Optional[int] = ..., layer: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class OuterParticipant(_message.Message):
    __slots__ = ("group", "tokens", "since_epoch", "node_ids")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    group: int
    tokens: int
    since_epoch: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group: _Optional[int] = ..., tokens: _Optional[int] = ..., since_epoch: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class OuterSyncReply(_message.Message):
    __slots__ = ("decided", "participants", "wait_seconds", "latest_round", "version", "final", "checkpointer", "inner_steps", "steps_round", "held")
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTER_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_ROUND_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    decided: bool
    participants: _containers.RepeatedCompositeFieldContainer[OuterParticipant]
    wait_seconds: float
    latest_round: int
    version: int
    final: bool
    checkpointer: OuterParticipant
    inner_steps: _containers.RepeatedCompositeFieldContainer[OuterGroupSteps]
    steps_round: int
    held: bool
    def __init__(self, decided: _Optional[bool] = ..., participants: _Optional[_Iterable[_Union[OuterParticipant, _Mapping]]] = ..., wait_seconds: _Optional[float] = ..., latest_round: _Optional[int] = ..., version: _Optional[int] = ..., final: _Optional[bool] = ..., checkpointer: _Optional[_Union[OuterParticipant, _Mapping]] = ..., inner_steps: _Optional[_Iterable[_Union[OuterGroupSteps, _Mapping]]] = ..., steps_round: _Optional[int] = ..., held: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("history_points",)
    HISTORY_POINTS_FIELD_NUMBER: _ClassVar[int]
    history_points: int
    def __init__(self, history_points: _Optional[int] = ...) -> None: ...

class LossPoint(_message.Message):
    __slots__ = ("first_step", "last_step", "width", "count", "loss", "loss_min", "loss_max", "tokens_per_second", "has_val_loss", "val_loss", "val_loss_min", "val_loss_max")
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MIN_FIELD_NUMBER: _ClassVar[int]
    LOSS_MAX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    HAS_VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_MIN_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_MAX_FIELD_NUMBER: _ClassVar[int]
    first_step: int
    last_step: int
    width: int
    count: int
    loss: float
    loss_min: float
    loss_max: float
    tokens_per_second: float
    has_val_loss: bool
    val_loss: float
    val_loss_min: float
    val_loss_max: float
    def __init__(self, first_step: _Optional[int] = ..., last_step: _Optional[int] = ..., width: _Optional[int] = ..., count: _Optional[int] = ..., loss: _Optional[float] = ..., loss_min: _Optional[float] = ..., loss_max: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., has_val_loss: _Optional[bool] = ..., val_loss: _Optional[float] = ..., val_loss_min: _Optional[float] = ..., val_loss_max: _Optional[float] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("node_id", "peer_address", "profile", "state", "last_heartbeat_unix", "joined_unix")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOINED_UNIX_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    profile: NodeProfile
    state: str
    last_heartbeat_unix: float
    joined_unix: float
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., profile: _Optional[_Union[NodeProfile, _Mapping]] = ..., state: _Optional[str] = ..., last_heartbeat_unix: _Optional[float] = ..., joined_unix: _Optional[float] = ...) -> None: ...

class StageUsage(_message.Message):
    __slots__ = ("node_id", "pipeline", "stage", "steps", "step_seconds", "compute_seconds", "wait_seconds", "utilisation", "peak_memory_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    pipeline: int
    stage: int
    steps: int
    step_seconds: float
    compute_seconds: float
    wait_seconds: float
    utilisation: float
    peak_memory_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., pipeline: _Optional[int] = ..., stage: _Optional[int] = ..., steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., utilisation: _Optional[float] = ..., peak_memory_bytes: _Optional[int] = ...) -> None: ...

class LinkUsage(_message.Message):
    __slots__ = ("src", "dst", "direction", "pipeline", "stage", "steps", "codec", "bytes_raw", "bytes_wire", "seconds", "achieved_bytes_per_s", "estimate_bytes_per_s")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BYTES_RAW_FIELD_NUMBER: _ClassVar[int]
    BYTES_WIRE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACHIEVED_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    direction: Direction
    pipeline: int
    stage: int
    steps: int
    codec: Codec
    bytes_raw: float
    bytes_wire: float
    seconds: float
    achieved_bytes_per_s: float
    estimate_bytes_per_s: float
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., direction: _Optional[_Union[Direction, str]] = ..., pipeline: _Optional[int] = ..., stage: _Optional[int] = ..., steps: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., bytes_raw: _Optional[float] = ..., bytes_wire: _Optional[float] = ..., seconds: _Optional[float] = ..., achieved_bytes_per_s: _Optional[float] = ..., estimate_bytes_per_s: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("job", "members", "islands", "plan", "links", "recent_steps", "step", "tokens_per_second", "last_checkpoint_step", "has_loss", "loss", "loss_step", "measured_step_seconds", "measured_steps", "stage_usage", "link_usage", "group_usage", "job_state", "finished_unix", "target_steps", "history", "history_resolution", "history_rows", "waiting", "stopped_unix", "anchor_mismatches", "anchor_mismatch", "final_checkpoint_step", "newest_backup_path", "newest_backup_unix", "offenders", "outer_exclusions", "outer_exclusion", "under_replicated", "network_fit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LOSS_STEP_FIELD_NUMBER: _ClassVar[int]
    MEASURED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STAGE_USAGE_FIELD_NUMBER: _ClassVar[int]
    LINK_USAGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_USAGE_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_RESOLUTION_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ROWS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STOPPED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    FINAL_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_BACKUP_PATH_FIELD_NUMBER: _ClassVar[int]
    NEWEST_BACKUP_UNIX_FIELD_NUMBER: _ClassVar[int]
    OFFENDERS_FIELD_NUMBER: _ClassVar[int]
    OUTER_EXCLUSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTER_EXCLUSION_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIT_FIELD_NUMBER: _ClassVar[int]
    job: JobInfo
    members: _containers.RepeatedCompositeFieldContainer[Member]
    islands: _containers.RepeatedCompositeFieldContainer[Island]
    plan: Plan
    links: _containers.RepeatedCompositeFieldContainer[LinkMeasurement]
    recent_steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    step: int
    tokens_per_second: float
    last_checkpoint_step: int
    has_loss: bool
    loss: float
    loss_step: int
    measured_step_seconds: float
    measured_steps: int
    stage_usage: _containers.RepeatedCompositeFieldContainer[StageUsage]
    link_usage: _containers.RepeatedCompositeFieldContainer[LinkUsage]
    group_usage: _containers.RepeatedCompositeFieldContainer[GroupUsage]
    job_state: str
    finished_unix: float
    target_steps: int
    history: _containers.RepeatedCompositeFieldContainer[LossPoint]
    history_resolution: str
    history_rows: int
    waiting: str
    stopped_unix: float
    anchor_mismatches: int
    anchor_mismatch: str
    final_checkpoint_step: int
    newest_backup_path: str
    newest_backup_unix: float
    offenders: _containers.RepeatedCompositeFieldContainer[Offender]
    outer_exclusions: int
    outer_exclusion: str
    under_replicated: _containers.RepeatedScalarFieldContainer[str]
    network_fit: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[_Union[JobInfo, _Mapping]] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., islands: _Optional[_Iterable[_Union[Island, _Mapping]]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., links: _Optional[_Iterable[_Union[LinkMeasurement, _Mapping]]] = ..., recent_steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., step: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., last_checkpoint_step: _Optional[int] = ..., has_loss: _Optional[bool] = ..., loss: _Optional[float] = ..., loss_step: _Optional[int] = ..., measured_step_seconds: _Optional[float] = ..., measured_steps: _Optional[int] = ..., stage_usage: _Optional[_Iterable[_Union[StageUsage, _Mapping]]] = ..., link_usage: _Optional[_Iterable[_Union[LinkUsage, _Mapping]]] = ..., group_usage: _Optional[_Iterable[_Union[GroupUsage, _Mapping]]] = ..., job_state: _Optional[str] = ..., finished_unix: _Optional[float] = ..., target_steps: _Optional[int] = ..., history: _Optional[_Iterable[_Union[LossPoint, _Mapping]]] = ..., history_resolution: _Optional[str] = ..., history_rows: _Optional[int] = ..., waiting: _Optional[str] = ..., stopped_unix: _Optional[float] = ..., anchor_mismatches: _Optional[int] = ..., anchor_mismatch: _Optional[str] = ..., final_checkpoint_step: _Optional[int] = ..., newest_backup_path: _Optional[str] = ..., newest_backup_unix: _Optional[float] = ..., offenders: _Optional[_Iterable[_Union[Offender, _Mapping]]] = ..., outer_exclusions: _Optional[int] = ..., outer_exclusion: _Optional[str] = ..., under_replicated: _Optional[_Iterable[str]] = ..., network_fit: _Optional[_Iterable[str]] = ...) -> None: ...

class JobControlRequest(_message.Message):
    __slots__ = ("job_id", "action", "steps", "node_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    action: str
    steps: int
    node_id: str
    def __init__(self, job_id: _Optional[str] = ..., action: _Optional[str] = ..., steps: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class JobControlReply(_message.Message):
    __slots__ = ("target_steps", "step", "message", "quarantined", "viewer_token")
    TARGET_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    VIEWER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    target_steps: int
    step: int
    message: str
    quarantined: _containers.RepeatedCompositeFieldContainer[Offender]
    viewer_token: str
    def __init__(self, target_steps: _Optional[int] = ..., step: _Optional[int] = ..., message: _Optional[str] = ..., quarantined: _Optional[_Iterable[_Union[Offender, _Mapping]]] = ..., viewer_token: _Optional[str] = ...) -> None: ...

class GroupUsage(_message.Message):
    __slots__ = ("group", "name", "inner_step", "tokens", "round", "rounds_in", "rounds_missed", "sync_bytes", "sync_seconds", "late_seconds", "steps_per_round", "wait_seconds_per_round", "token_share", "planned", "step_seconds", "assigned_steps", "round_target_seconds")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_IN_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_MISSED_FIELD_NUMBER: _ClassVar[int]
    SYNC_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SHARE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group: int
    name: str
    inner_step: int
    tokens: int
    round: int
    rounds_in: int
    rounds_missed: int
    sync_bytes: float
    sync_seconds: float
    late_seconds: float
    steps_per_round: float
    wait_seconds_per_round: float
    token_share: float
    planned: bool
    step_seconds: float
    assigned_steps: int
    round_target_seconds: float
    def __init__(self, group: _Optional[int] = ..., name: _Optional[str] = ..., inner_step: _Optional[int] = ..., tokens: _Optional[int] = ..., round: _Optional[int] = ..., rounds_in: _Optional[int] = ..., rounds_missed: _Optional[int] = ..., sync_bytes: _Optional[float] = ..., sync_seconds: _Optional[float] = ..., late_seconds: _Optional[float] = ..., steps_per_round: _Optional[float] = ..., wait_seconds_per_round: _Optional[float] = ..., token_share: _Optional[float] = ..., planned: _Optional[bool] = ..., step_seconds: _Optional[float] = ..., assigned_steps: _Optional[int] = ..., round_target_seconds: _Optional[float] = ...) -> None: ...

class ProbeChunk(_message.Message):
    __slots__ = ("sender", "payload")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    sender: str
    payload: bytes
    def __init__(self, sender: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("bytes", "receive_seconds", "node_id")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    receive_seconds: float
    node_id: str
    def __init__(self, bytes: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., node_id: _Optional[str] = ...) -> None: ...

class OuterFetchRequest(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "round", "kind", "names", "sender", "origin")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    round: int
    kind: str
    names: _containers.RepeatedScalarFieldContainer[str]
    sender: str
    origin: str
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., round: _Optional[int] = ..., kind: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., sender: _Optional[str] = ..., origin: _Optional[str] = ...) -> None: ...

class ConnectFrame(_message.Message):
    __slots__ = ("node_id", "call", "method", "message", "end", "code", "details", "reply", "timeout_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    call: int
    method: str
    message: bytes
    end: bool
    code: int
    details: str
    reply: bool
    timeout_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., call: _Optional[int] = ..., method: _Optional[str] = ..., message: _Optional[bytes] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., reply: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class StateFetchRequest(_message.Message):
    __slots__ = ("job_id", "kind", "step", "layer_start", "layer_end", "offset", "sender")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: str
    step: int
    layer_start: int
    layer_end: int
    offset: int
    sender: str
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[str] = ..., step: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., offset: _Optional[int] = ..., sender: _Optional[str] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("total_bytes", "checksum", "offset", "data", "chunk_checksum", "step", "layer_start", "layer_end")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    checksum: int
    offset: int
    data: bytes
    chunk_checksum: int
    step: int
    layer_start: int
    layer_end: int
    def __init__(self, total_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., chunk_checksum: _Optional[int] = ..., step: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class HeldStateRequest(_message.Message):
    __slots__ = ("job_id", "plan_epoch", "sender")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    plan_epoch: int
    sender: str
    def __init__(self, job_id: _Optional[str] = ..., plan_epoch: _Optional[int] = ..., sender: _Optional[str] = ...) -> None: ...

class HeldStateReply(_message.Message):
    __slots__ = ("holds", "step", "layer_start", "layer_end", "bytes", "plan_epoch", "node_id", "pending", "has_norm_total", "norm_total", "has_pending_loss", "pending_loss", "pending_weight", "replica_group", "outer_round", "steps_in_round", "inner_steps", "outer_landed")
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    HAS_NORM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NORM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HAS_PENDING_LOSS_FIELD_NUMBER: _ClassVar[int]
    PENDING_LOSS_FIELD_NUMBER: _ClassVar[int]
    PENDING_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GROUP_FIELD_NUMBER: _ClassVar[int]
    OUTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    STEPS_IN_ROUND_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUTER_LANDED_FIELD_NUMBER: _ClassVar[int]
    holds: bool
    step: int
    layer_start: int
    layer_end: int
    bytes: int
    plan_epoch: int
    node_id: str
    pending: bool
    has_norm_total: bool
    norm_total: float
    has_pending_loss: bool
    pending_loss: float
    pending_weight: float
    replica_group: str
    outer_round: int
    steps_in_round: int
    inner_steps: int
    outer_landed: bool
    def __init__(self, holds: _Optional[bool] = ..., step: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., bytes: _Optional[int] = ..., plan_epoch: _Optional[int] = ..., node_id: _Optional[str] = ..., pending: _Optional[bool] = ..., has_norm_total: _Optional[bool] = ..., norm_total: _Optional[float] = ..., has_pending_loss: _Optional[bool] = ..., pending_loss: _Optional[float] = ..., pending_weight: _Optional[float] = ..., replica_group: _Optional[str] = ..., outer_round: _Optional[int] = ..., steps_in_round: _Optional[int] = ..., inner_steps: _Optional[int] = ..., outer_landed: _Optional[bool] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("job_id", "step", "layer_start", "layer_end", "source", "source_address", "plan_epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PLAN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    layer_start: int
    layer_end: int
    source: str
    source_address: str
    plan_epoch: int
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., source: _Optional[str] = ..., source_address: _Optional[str] = ..., plan_epoch: _Optional[int] = ...) -> None: ...

class ReplicateReply(_message.Message):
    __slots__ = ("bytes", "seconds", "path", "file_bytes", "checksum")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    path: str
    file_bytes: int
    checksum: int
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., path: _Optional[str] = ..., file_bytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...
