"""``restkv.observe``, the path earlier docs showed for what a scorer sees: now ``restkv.scoring.observe``."""

from .scoring.observe import *  # noqa: F401,F403
from .scoring.observe import Observation, group_view, weighted_values  # noqa: F401
