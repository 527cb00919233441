"""Tensor parallelism on one host: the communicator and the sharding of a model's weights."""

from tidal.parallel.comm import (
    PeerAborted,
    ShmComm,
    SingleRank,
    TPCommError,
    create_segment,
    unlink_segment,
)

__all__ = ["PeerAborted", "ShmComm", "SingleRank", "TPCommError", "create_segment", "unlink_segment"]
