"""The save path: the DCP StorageWriter protocol and everything one save runs through.

In the order a save meets them: :mod:`.writer` (the DCP protocol, thin), :mod:`.parts` (the
writer's options checked and its parts built), :mod:`.controls` (the public API beyond DCP),
:mod:`.capture` (the state captured at the call: lazy, at-call or owned copies), :mod:`.barrier`
(the optimizer-step barrier), :mod:`.contexts`, :mod:`.binding` and :mod:`.jobs` (per-thread save
contexts, staged jobs and their failures), :mod:`.planner`, :mod:`.global_plan` and
:mod:`.plan_cache` (DCP's planning, its global step in linear time, plan caching keyed by
structure), :mod:`.wire` (plans and results as DCP moves them between ranks), :mod:`.early`,
:mod:`.placement` and :mod:`.late_capture` (items placed in data files, bytes flushed by the
engine), :mod:`.completion` (the wait until they are durable, the manifest), :mod:`.incremental`,
:mod:`.extensions` and :mod:`.safetensors_writer` (the variants of placement), :mod:`.finish` and
:mod:`.rank_commit` (a rank's write handed over or completed, other ranks' durability reports, the
commit), :mod:`.release` and :mod:`.stats`.
Nothing here is imported by :mod:`dcp_datastates.format`,
:mod:`dcp_datastates.restore` or :mod:`dcp_datastates.storage`.
"""
