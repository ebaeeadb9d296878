"""The Lightning adapter: everything that speaks Lightning or torchmetrics.

``MegatronStrategy`` drives the machinery below (``engine``, ``distributed``, ``pipeline``, ...), which
knows nothing of Lightning; here live what a Lightning step means for it (the user's hooks on the last
stage, ``self.log`` capture and replay, torchmetrics states kept equal over pipeline stages), the
precision plugins, resumable loaders, the sampler check and the throughput callback.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_face

__getattr__, __dir__ = lazy_face(__name__, {
    "MegatronStrategy": ".strategy",
    "MegatronThroughputMonitor": ".callbacks",
    "parallel_precision": ".precision",
    "ShardedCheckpointIO": ".checkpoint_io",
})

if TYPE_CHECKING:
    from .callbacks import MegatronThroughputMonitor
    from .checkpoint_io import ShardedCheckpointIO
    from .precision import parallel_precision
    from .strategy import MegatronStrategy

__all__ = ["MegatronStrategy", "MegatronThroughputMonitor", "ShardedCheckpointIO", "parallel_precision"]
