"""DataStatesSavePlanner: DCP's default save planner, with the semantics DataStatesWriter needs.

DataStatesWriter works with DCP's DefaultSavePlanner (what ``dcp.save``/``dcp.async_save`` use
when no planner is given): it finds a save's captured tensors through ``planner.state_dict``. This
subclass keeps every DefaultSavePlanner behaviour (flattening, deduplication of replicated items
onto the least-loaded rank, plan caching) and only makes that contract explicit: the planner must
keep the staged state dict it was set up with, unchanged, in ``self.state_dict``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta


class DataStatesSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner with the staged-dict contract checked.

    Keyword arguments are those of DefaultSavePlanner (``flatten_state_dict``,
    ``dedup_save_to_lowest_rank``, ``enable_plan_caching``, ...).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def set_up_planner(
        self,
        state_dict: Any,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if not isinstance(getattr(self, "state_dict", None), dict):
            raise TypeError("DataStatesSavePlanner: the planner lost the staged state dict")
