"""ntp_ds: nonuniform tensor parallelism for DeepSpeed."""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Build an NTPEngine; see `ntp_ds.engine.initialize`."""
    from ntp_ds.engine import initialize as _initialize

    return _initialize(*args, **kwargs)
