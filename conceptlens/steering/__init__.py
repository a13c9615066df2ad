"""Put concepts back into the model: edits at sites, applied inside `lens.steer(...)`."""

from conceptlens.steering.edits import Add, Clamp, CodeAblate, Edit, ProjectOut
from conceptlens.steering.scope import Positions, Steer

__all__ = ["Add", "Clamp", "CodeAblate", "Edit", "ProjectOut", "Positions", "Steer"]
