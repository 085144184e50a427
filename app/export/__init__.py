"""Export: a trained drafter as the Hugging Face DFlash directory that SGLang and vLLM load."""

from app.export.hf_dflash import check_fits_target, export_config, export_drafter, load_exported
from app.export.source import TrainedDrafter, load_trained_drafter

__all__ = [
    "TrainedDrafter",
    "check_fits_target",
    "export_config",
    "export_drafter",
    "load_exported",
    "load_trained_drafter",
]
