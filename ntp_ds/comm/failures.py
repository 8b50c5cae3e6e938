"""What ends a rank's work, by whose failure: a peer's (`PeerFailure`: recover without it) or this rank's own device
(`DeviceError`: this rank leaves, its peers recover). `wire.is_wire_failure` tells the two apart for any error."""


class PeerFailure(RuntimeError):
    """A wait ended because a peer was declared dead (hung or gone) by the liveness watcher."""


class DeviceError(RuntimeError):
    """This rank's device failed (or a failure was injected): the worker must treat its own GPU as lost."""
