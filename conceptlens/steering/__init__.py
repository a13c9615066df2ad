"""Put concepts back into the model: edits at sites, applied inside `lens.steer(...)`."""

from conceptlens.steering.ablate import Ablate
from conceptlens.steering.edits import Add, Clamp, CodeAblate, Edit, ProjectOut
from conceptlens.steering.scope import Positions, Steer
from conceptlens.steering.sweep import Generation, SweepResult, sweep, token_logprob
from conceptlens.steering.units import robust_norm, site_norm
from conceptlens.steering.vectors import AddKeepNorm, SteeringVector, train_vector

__all__ = ["Ablate", "Add", "AddKeepNorm", "SteeringVector", "train_vector", "Clamp", "CodeAblate", "Edit",
           "Generation", "ProjectOut", "Positions", "Steer", "SweepResult", "robust_norm", "site_norm", "sweep",
           "token_logprob"]
