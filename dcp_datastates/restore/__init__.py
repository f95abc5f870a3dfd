"""Loading checkpoints: :mod:`.reader` (``DataStatesReader``, verified parallel reads),
:mod:`.safetensors_reader` and :mod:`.load` (``dcp_datastates.load``: any of our formats in one
call). The stock ``dcp.load`` needs none of this."""
