"""DataStates-style config dicts: accepted keys, mapping onto writer arguments, clear errors."""

from __future__ import annotations

import pytest

from dcp_datastates.integrations.config import writer_from_config, writer_kwargs


def test_datastates_keys_map_onto_writer_arguments() -> None:
    kw = writer_kwargs({"host_cache_size": 2, "parser_threads": 3, "pin_host_cache": False})
    assert kw == {"host_cache_size": 2, "copy_threads": 3, "pin_memory": False}


def test_writer_arguments_pass_through_and_none_is_defaults() -> None:
    assert writer_kwargs({"chunk_size": "8MiB", "capture": "eager"}) == {
        "chunk_size": "8MiB",
        "capture": "eager",
    }
    assert writer_kwargs(None) == {}
    assert writer_kwargs({}) == {}


def test_unknown_key_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"ds_config\['datastates_ckpt'\].*'host_cache_sze'"):
        writer_kwargs({"host_cache_sze": 1}, where="ds_config['datastates_ckpt']")
    with pytest.raises(ValueError, match="'path'"):
        writer_kwargs({"path": "/tmp/x"})


def test_alias_and_target_together_is_an_error() -> None:
    with pytest.raises(ValueError, match="'copy_threads'"):
        writer_kwargs({"parser_threads": 2, "copy_threads": 2})


def test_non_mapping_and_non_string_keys() -> None:
    with pytest.raises(TypeError, match="mapping"):
        writer_kwargs([("host_cache_size", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strings"):
        writer_kwargs({1: 2})  # type: ignore[dict-item]


def test_writer_from_config_builds_a_working_writer(tmp_path) -> None:
    w = writer_from_config(str(tmp_path), {"host_cache_size": "64MiB", "parser_threads": 1})
    try:
        assert w.config.cache_bytes == 64 * 1024**2
        assert w.config.copy_threads == 1
    finally:
        w.close()
    with pytest.raises(ValueError, match="host_cache_size"):
        writer_from_config(str(tmp_path), {"host_cache_size": -1})
