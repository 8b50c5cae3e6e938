"""Live recovery: recovery plans, re-slicing of optimizer state, and the manager that turns a failure into a new
generation's engine."""

_PUBLIC = ("Recovery", "RecoveryImpossible", "RecoveryOutcome", "NoReplicaLeft", "JoinFailed")
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    # On first use, not at import: the engine imports this package's pure modules, and the manager imports the engine.
    if name in _PUBLIC:
        from ntp_ds.recovery import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
