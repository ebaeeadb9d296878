"""Fine-tuning LightningModules for the paper's downstream tasks (seed 002, section 5.3): MNLI and RACE."""

from .base import BertFinetuneModule
from .mnli import BertForMNLI
from .model import BertShape, build_task_model
from .optim import adamw_with_warmup, warmup_linear_decay
from .race import BertForRACE

__all__ = ["BertFinetuneModule", "BertForMNLI", "BertForRACE", "BertShape", "adamw_with_warmup",
           "build_task_model", "warmup_linear_decay"]
