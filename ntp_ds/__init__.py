"""ntp_ds: nonuniform tensor parallelism for DeepSpeed."""

__version__ = "0.1.0"


def initialize(model, config, ntp=None, *args, **kwargs):
    """Build this rank's NTPEngine (`ntp_ds.engine.initialize`); with `ntp["fault_tolerance"]` on, a
    `FaultTolerantEngine` that recovers from a lost GPU inside the caller's own loop (`ntp_ds.fault_tolerant`)."""
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.testing import register_test_backend

    register_test_backend()
    ntp = NTPConfig.from_any(ntp)
    if ntp.fault_tolerance.enabled:
        from ntp_ds.fault_tolerant import initialize as fault_tolerant

        return fault_tolerant(model, config, ntp, *args, **kwargs)
    if "on_event" in kwargs:
        raise TypeError("on_event= is for ntp['fault_tolerance'] runs: without it no recovery or join happens")
    from ntp_ds.engine import initialize as _initialize

    return _initialize(model, config, ntp, *args, **kwargs)
