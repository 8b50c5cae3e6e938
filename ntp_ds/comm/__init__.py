"""Communication: every call that crosses the wire (wire.py), process groups and DeepSpeed's mpu view of them,
and the exchanges between replicas of different layouts (bucketed units, gradients and parameters streamed)."""
