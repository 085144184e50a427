"""Regenerate training conversations with the target through OpenAI-compatible servers (`dflash datagen`)."""

from app.datagen.runner import DatagenReport, run_datagen

__all__ = ["DatagenReport", "run_datagen"]
