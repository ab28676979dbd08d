"""Mixture-of-experts token dispatch for MLX: plan, gather, combine, unsort."""

import mlx.core  # noqa: F401  (loads libmlx before the extension that links it)

from ._sizes import MAX_EXPERTS
from .combine import moe_combine
from .gather import moe_gather, moe_unsort
from .plan import MoEPlan, moe_plan

__all__ = ["MAX_EXPERTS", "MoEPlan", "moe_combine", "moe_gather", "moe_plan", "moe_unsort"]
