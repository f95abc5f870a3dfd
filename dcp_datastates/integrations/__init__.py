"""Adapters that put DataStatesWriter behind the checkpoint interfaces of training frameworks.

One module per framework; each imports its framework lazily, so importing this package never
imports DeepSpeed, Lightning, Accelerate, torchtitan or Nanotron. Shared pieces:
:mod:`dcp_datastates.integrations.config` (DataStates-style configuration dicts -> writer).
See docs/integrations.md for the lines each framework needs and what is guaranteed.
"""
