"""Spec -> ds_config: the strict spec, the named presets, the pure builder, the checker, and the converter back from
an existing ds_config."""
