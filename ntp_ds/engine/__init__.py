"""The DeepSpeed integration: NTP configuration, the NTPEngine and `initialize`."""

from ntp_ds.engine.config import ConfigError, NTPConfig
from ntp_ds.engine.engine import NTPEngine
from ntp_ds.engine.initialize import initialize

__all__ = ["ConfigError", "NTPConfig", "NTPEngine", "initialize"]
