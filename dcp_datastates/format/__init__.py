"""The on-disk format: what a checkpoint directory holds and how it is checked.

:mod:`.layout` (torch.save archives around raw tensor bytes), :mod:`.manifest` (per-rank
manifests with CRC-32C per chunk), :mod:`.commit` (the claim, the in-progress marker, ``.metadata``
last), :mod:`.refs` and :mod:`.refcheck` (references of incremental checkpoints),
:mod:`.safetensors` (the safetensors layout), :mod:`.verify` and :mod:`.export`. See
docs/format.md. Depends on :mod:`dcp_datastates.storage` only; never on the save path.
"""
