"""DataStates-style configuration dicts, as frameworks pass them, turned into writer arguments.

DataStates-LLM is configured by framework config, e.g. DeepSpeed's
``"datastates_ckpt": {"host_cache_size": 16, "parser_threads": 2, "pin_host_cache": true}`` or
Nanotron's ``datastates: {host_cache_size: 16, ...}``. Every adapter accepts those keys, plus any
keyword argument of :class:`~dcp_datastates.DataStatesWriter` under its own name. Unknown keys are
an error naming the key (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

#: DataStates-LLM's own keys and the writer argument each one sets.
DATASTATES_KEYS: dict[str, str] = {
    "host_cache_size": "host_cache_size",  # GiB, as in DataStates
    "parser_threads": "copy_threads",  # DataStates' threads that copy/serialise tensors
    "pin_host_cache": "pin_memory",  # page-lock the cache for CUDA copies
}


def _writer_parameters() -> set[str]:
    from ..save.writer import DataStatesWriter

    params = inspect.signature(DataStatesWriter.__init__).parameters
    return {name for name in params if name not in ("self", "path")}


def writer_kwargs(config: Mapping[str, Any] | None, *, where: str = "config") -> dict[str, Any]:
    """Returns DataStatesWriter keyword arguments for a DataStates-style config mapping.

    ``None`` or an empty mapping gives ``{}`` (the writer's defaults). ``where`` names the config
    in error messages (e.g. ``"ds_config['datastates_ckpt']"``).

    Raises:
        TypeError: ``config`` is not a mapping, or a key is not a string.
        ValueError: a key is unknown (the message names it and lists the accepted keys), or a
            DataStates key and the writer argument it maps to are both given.
    """
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise TypeError(f"{where} must be a mapping of settings, not {type(config).__name__}")
    accepted = _writer_parameters()
    out: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: setting names must be strings, got {key!r}")
        target = DATASTATES_KEYS.get(key, key)
        if target not in accepted:
            names = sorted(set(DATASTATES_KEYS) | accepted)
            raise ValueError(f"{where}: unknown setting {key!r}; accepted: {', '.join(names)}")
        if target in out:
            raise ValueError(f"{where}: {key!r} sets {target!r}, which is already given")
        out[target] = value
    return out


def writer_from_config(
    path: str, config: Mapping[str, Any] | None, *, where: str = "config"
) -> Any:
    """Creates a :class:`~dcp_datastates.DataStatesWriter` for ``path`` from a config mapping."""
    from ..save.writer import DataStatesWriter

    return DataStatesWriter(path, **writer_kwargs(config, where=where))
