"""Side losses: eager penalties (``eager``), gradient transforms (``transforms``) and the
chunked LM-head loss (``lm_head``); ``offload`` parks stored gradients in host memory."""

from .eager import side_loss
from .lm_head import chunked_linear_cross_entropy
from .transforms import scale_grad, transform_grad

__all__ = ["chunked_linear_cross_entropy", "scale_grad", "side_loss", "transform_grad"]
