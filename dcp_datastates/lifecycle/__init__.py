"""Committed checkpoints over time: :mod:`.checkpoints` (listing, retention, cleanup),
:mod:`.tiers` (promotion to a persistent tier, ``resume_path``), the persistence agent that runs
promotions outside the trainer (:mod:`.persist_agent`, :mod:`.persist_client`,
:mod:`.persist_queue`) and :mod:`.remote` (the same on object stores)."""
