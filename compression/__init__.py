"""atoll.compression: codecs, error feedback, link policy and the tensor wire format.

Uses only the core (`atoll`); never grpc.
"""

from atoll.compression import blockquant, cast, hadamard, lowrank, sparse, topk  # noqa: F401  (each registers its codecs)
from atoll.compression.codec import Codec, Payload, check_registry, registered
from atoll.compression.errors import CodecError
from atoll.compression.feedback import ErrorFeedback
from atoll.compression.limits import WireLimits
from atoll.compression.policy import (
    Decision,
    LinkPolicy,
    PolicyConfig,
    predict_transfer_seconds,
)
from atoll.compression.spec import CodecSpec
from atoll.compression.tensor import EncodedTensor, decode_tensor, encode_tensor, get_codec
from atoll.compression.wire import AssembledTensor, ChunkAssembler, encoded_to_chunks, tensor_to_chunks
from atoll.serde import CODEC_NAME
from atoll.v1 import atoll_pb2 as _pb

check_registry(list(_pb.Codec.values()), CODEC_NAME)

__all__ = [
    "AssembledTensor",
    "ChunkAssembler",
    "Codec",
    "CodecError",
    "CodecSpec",
    "Decision",
    "EncodedTensor",
    "ErrorFeedback",
    "LinkPolicy",
    "Payload",
    "PolicyConfig",
    "WireLimits",
    "decode_tensor",
    "encode_tensor",
    "encoded_to_chunks",
    "get_codec",
    "predict_transfer_seconds",
    "registered",
    "tensor_to_chunks",
]
