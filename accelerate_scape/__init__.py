"""Accelerate adapter for SCAPE (see accelerate_scape.plugin)."""
