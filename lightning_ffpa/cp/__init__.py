"""Context parallelism (CP): one sequence split over the ranks of a CP group, attention run as a ring.

Layout (``layout.py``: head-tail chunks, ``RingLayout``), sharding (``sharding.py``: ``shard_batch``,
``unshard``), the loss reduction (``loss.py``: ``cp_loss_reduce``), the process group (``group.py``), and
the rings: FFPA blocks for full layers (``ring.py``, ``plan.py``), a halo + Flex for sliding layers
(``sliding.py``), Flex blocks as a baseline (``flex_blocks.py``). Importing this package loads only the
torch-level pieces; ``lightning_ffpa.cp.ring`` (``install_ring``) also loads the attention kernels.
The device mesh is the strategy's (``lightning_ffpa.parallel``); the attention Callback installs the ring.
"""

from lightning_ffpa.cp.group import cp_group_info
from lightning_ffpa.cp.layout import RingLayout, shard_index
from lightning_ffpa.cp.loss import cp_loss_reduce
from lightning_ffpa.cp.sharding import IGNORE_INDEX, shard_batch, unshard

__all__ = ["IGNORE_INDEX", "RingLayout", "cp_group_info", "cp_loss_reduce", "shard_batch", "shard_index", "unshard"]
