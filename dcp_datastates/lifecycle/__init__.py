"""Committed checkpoints over time: :mod:`.checkpoints` (listing, retention, cleanup),
:mod:`.tiers` (promotion to a persistent tier, ``resume_path``) and :mod:`.remote` (the same on
object stores)."""
