"""Regenerate training conversations with the target through OpenAI-compatible servers (`dflash datagen`)."""

from app.datagen.run import DatagenReport
from app.datagen.runner import run_datagen

__all__ = ["DatagenReport", "run_datagen"]
