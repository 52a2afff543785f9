"""Lightning adapter for SCAPE (see lightning_scape.strategy)."""
