"""Tensor parallelism on one host: the communicator and the sharding of a model's weights."""

from tidal.parallel.comm import (
    ShmComm,
    SingleRank,
    TPCommError,
    create_segment,
    unlink_segment,
)

__all__ = ["ShmComm", "SingleRank", "TPCommError", "create_segment", "unlink_segment"]
