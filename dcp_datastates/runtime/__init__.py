"""Process-wide concerns the save and load paths share: :mod:`.gcpause` (garbage-collector
pauses), :mod:`.cpuload` (the machine's CPU load), :mod:`.dcplog` (DCP's debug events) and
:mod:`.progress` (progress lines of long CLI operations)."""
