"""Communication: process groups for a topology, DeepSpeed's mpu view of them, and unit exchange between ranks."""
