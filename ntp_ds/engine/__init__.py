"""The DeepSpeed integration: NTP configuration, the NTPEngine, `initialize`, and the optimizer state each anchor
keeps copies of on other replicas."""

from ntp_ds.engine.config import ConfigError, NTPConfig
from ntp_ds.engine.engine import NTPEngine
from ntp_ds.engine.initialize import initialize

__all__ = ["ConfigError", "NTPConfig", "NTPEngine", "initialize"]
