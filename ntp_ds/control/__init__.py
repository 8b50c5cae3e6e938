"""Control plane: the store outside every rank, heartbeats, membership agreement and fault injection."""

from ntp_ds.comm.failures import DeviceError
from ntp_ds.control.faults import Fault, FaultInjector, FaultSchedule, send_fault
from ntp_ds.control.heartbeat import Heartbeat
from ntp_ds.control.liveness import LivenessMonitor
from ntp_ds.control.liveness_store import LivenessReader, NodePublisher, mark_exited, poll_liveness
from ntp_ds.control.membership import (BarrierTimeout, Evicted, Membership, MembershipChange, MembershipTimeout,
                                       StaleGeneration, barrier)
from ntp_ds.control.store import connect_from_env, connect_store, generation_store, host_store

__all__ = ["BarrierTimeout", "DeviceError", "Evicted", "Fault", "FaultInjector", "FaultSchedule", "Heartbeat",
           "LivenessMonitor", "LivenessReader", "Membership", "MembershipChange", "MembershipTimeout", "NodePublisher",
           "StaleGeneration", "barrier", "connect_from_env", "connect_store", "generation_store", "host_store",
           "mark_exited", "poll_liveness", "send_fault"]
