"""The models: the frozen target (features), the DFlash drafter, its attention mask and objective."""

from app.model.attention import UncompiledKernelOnCudaError, training_attention, training_block_mask
from app.model.drafter import ContextCache, DFlashDrafter, DrafterArch
from app.model.objective import LossOutput, drafter_loss, feature_noise_std
from app.model.target import TargetModel, load_target, target_text_config

__all__ = [
    "ContextCache",
    "DFlashDrafter",
    "DrafterArch",
    "LossOutput",
    "TargetModel",
    "UncompiledKernelOnCudaError",
    "drafter_loss",
    "feature_noise_std",
    "load_target",
    "target_text_config",
    "training_attention",
    "training_block_mask",
]
