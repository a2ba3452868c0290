"""The actor-critic family: IAC (a critic per agent) and MAAC (one centralised critic)."""

from .ac_base import ActorCriticTrainerBase, RolloutSample
from .buffers import ActorCriticBufferData, MAACBufferData
from .config import ActorCriticConfig
from .iac import IACConfig, IACTrainer
from .maac import MAACConfig, MAACTrainer

__all__ = ["ActorCriticTrainerBase", "IACConfig", "IACTrainer", "RolloutSample", "MAACConfig", "MAACTrainer",
           "ActorCriticConfig", "ActorCriticBufferData", "MAACBufferData"]
