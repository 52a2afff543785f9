"""accelerate_scape: SCAPE for Hugging Face Accelerate, configured like Accelerate.

    accelerate-scape config --sparsity 0.99       # once: writes scape_config.yaml next to Accelerate's config
    accelerate-scape launch --multi_gpu train.py  # exactly `accelerate launch`, the SCAPE settings set exported

    from accelerate_scape import ScapePlugin      # in train.py
    scape = ScapePlugin()
    model, optimizer, loader, scheduler = scape.prepare(accelerator, model, optimizer, loader, scheduler)
"""

from accelerate_scape.plugin import ScapePlugin
from accelerate_scape.settings import Settings, default_config_file, resolve_settings, write_config_file

__all__ = ["ScapePlugin", "Settings", "default_config_file", "resolve_settings", "write_config_file"]
