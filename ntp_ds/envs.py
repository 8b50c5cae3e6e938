"""Every environment variable ntp_ds reads or sets, named once: the launch contract its workers start under, its own
settings, and torch's, NCCL's, CUDA's and DeepSpeed's that it sets or refuses (`ntp_ds.comm.groups`,
`ntp_ds.engine.initialize`). Modules name a variable through these constants, never by its string."""

# -- the launch contract: what every launcher (ntp-ds launch, torchrun, deepspeed) gives a worker ---------------
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# -- ntp_ds's own -------------------------------------------------------------------------------------------------
STORE_ENV = "NTP_STORE"
"""Through which the launcher passes the store's HOST:PORT (or an etcd address) to workers."""
JOIN_ENV = "NTP_JOIN"
"""Set (to 1) in a worker that joins a running job (`ntp-ds launch --join`, a repair, a joiner of `run_ranks`);
`NTP_JOIN_STEP` is then the first step it may train."""
JOIN_STEP_ENV = "NTP_JOIN_STEP"
"""A joiner's first step it may train."""
RUN_DIR_ENV = "NTP_RUN_DIR"
"""The run directory `ntp-ds launch --run-dir` gives its workers."""
NODE_SIZE_ENV = "NTP_NODE_SIZE"
"""Through which the launcher tells its workers how many ranks each node runs (rank r lives on node r // size) and
that every node's launcher publishes `node/{n}`."""
NODE_STORE_ENV = "NTP_NODE_STORE"
"""Through which `ntp-ds launch` passes its node's own store (HOST:PORT on this machine) to its workers: they beat
there, and their watchers read the launcher's copy of the node keys they poll (`ntp_ds.control.node_store`)."""
RACK_STORE_ENV = "NTP_RACK_STORE"
"""Through which `ntp-ds launch` passes its rack's store (HOST:PORT, hosted by the launcher of the rack's first node)
to its workers: a node's side of a barrier meets its rack's there, and the job's store sees one arrival per rack
(`ntp_ds.control.node_local`)."""
RACK_SIZE_ENV = "NTP_RACK_SIZE"
"""Through which the launcher tells its workers how many contiguous nodes form a rack (`launcher.rack_size`): rank r
lives in rack r // node size // rack size. Under torchrun or deepspeed, export it; the node size is then
LOCAL_WORLD_SIZE."""
ETCD_COMPACT_ENV = "NTP_ETCD_COMPACT_EVERY"
"""Revisions of an etcd store's history between two compactions by the job (`EtcdStore.compact_if_due`; default
10,000): fewer keep less history in the cluster's space quota, more cost fewer compactions."""
SENTINEL_ENV = "NTP_SENTINEL"
"""`0`: no sentinel; `child`: this process is the worker a sentinel started."""
TEST_BACKEND_ENV = "NTP_TEST_BACKEND"
"""Run on another backend than the device's: `nccl_model` (NCCL's rules on CPU, for tests) or `gloo`."""
TEST_DEVICE_ENV = "NTP_TEST_DEVICE"
"""The device the test spawner's ranks use (cpu by default)."""
MODEL_OFF_ENV = "NTP_NCCL_MODEL_OFF"
"""Rules of the test backend switched off, comma-separated (each rule's negative test)."""
MODEL_DEADLOCK_ENV = "NTP_NCCL_MODEL_DEADLOCK_S"
"""How long the test backend lets a wait that NCCL would never end run before it reports the deadlock."""

# -- torch's, NCCL's, CUDA's and DeepSpeed's ------------------------------------------------------------------------
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_DUMP_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
"""torch's switch for NCCL flight-recorder dumps on a failed op, signalled to every rank through the store."""
NCCL_DUMP_WAIT_ENV = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
NCCL_MONITORING_ENV = "TORCH_NCCL_ENABLE_MONITORING"
NCCL_BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"
NCCL_DESYNC_DEBUG_ENV = "TORCH_NCCL_DESYNC_DEBUG"
NONBLOCKING_ENV = "TORCH_NCCL_USE_COMM_NONBLOCKING"
NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""torch's bound, in seconds, on a non-blocking communicator's wait to be ready (and on each NCCL call in progress);
read once per process, at its first use."""
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
"""gRPC's switch for its fork handlers, read when grpc is first imported (`control.etcd_store`)."""
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
DS_ACCELERATOR = "DS_ACCELERATOR"
OMP_NUM_THREADS = "OMP_NUM_THREADS"
