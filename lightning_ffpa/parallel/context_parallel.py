"""Context-parallel sharding and loss reduction, under the import path earlier releases documented.

Owns nothing: the code lives in `lightning_ffpa.cp`; import from there.
"""

from lightning_ffpa.cp import (
    IGNORE_INDEX,
    RingLayout,
    cp_group_info,
    cp_loss_reduce,
    shard_batch,
    shard_index,
    unshard,
)

__all__ = ["IGNORE_INDEX", "RingLayout", "cp_group_info", "cp_loss_reduce", "shard_batch", "shard_index", "unshard"]
