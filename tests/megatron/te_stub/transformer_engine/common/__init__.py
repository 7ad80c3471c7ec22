"""transformer_engine.common (stand-in): only ``recipe``."""
from . import recipe  # noqa: F401,E402
