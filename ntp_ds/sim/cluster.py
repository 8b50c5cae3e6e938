"""Cluster layout: GPUs, scale-up domains, TP groups, pipeline stages, replicas.

GPUs are numbered ``0 .. N-1``; domain ``d`` holds GPUs ``[d*S, (d+1)*S)``.
A TP group is ``t`` consecutive GPUs inside one domain (``t`` divides ``S``),
so group ``g`` holds GPUs ``[g*t, (g+1)*t)``.  A data-parallel replica is
``pp`` consecutive TP groups (one per pipeline stage); replica ``r`` owns
groups ``[r*pp, (r+1)*pp)``.  A replica therefore fits inside one domain when
``t*pp <= S`` and spans ``t*pp/S`` whole domains otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ClusterConfig


@dataclass(frozen=True)
class Layout:
    num_gpus: int
    domain_size: int
    tp: int
    pp: int

    @classmethod
    def from_config(cls, c: ClusterConfig, tp: int | None = None) -> "Layout":
        """The job's layout; with hot spares a domain's active GPUs form its domain."""
        return cls(c.num_gpus, c.domain_size - c.hot_spares, c.tp if tp is None else tp, c.pp)

    @property
    def num_domains(self) -> int:
        return self.num_gpus // self.domain_size

    @property
    def num_groups(self) -> int:
        return self.num_gpus // self.tp

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def num_replicas(self) -> int:
        return self.num_gpus // self.replica_gpus

    @property
    def groups_per_domain(self) -> int:
        return self.domain_size // self.tp

    @property
    def domains_per_replica(self) -> float:
        return self.replica_gpus / self.domain_size

    def domain_of_gpu(self, gpu: np.ndarray | int) -> np.ndarray | int:
        return gpu // self.domain_size

    def group_of_gpu(self, gpu: np.ndarray | int) -> np.ndarray | int:
        return gpu // self.tp

    def replica_of_group(self, group: np.ndarray | int) -> np.ndarray | int:
        return group // self.pp

    def domain_gpus(self, domain: int) -> np.ndarray:
        return np.arange(domain * self.domain_size, (domain + 1) * self.domain_size)

    def block_gpus(self, gpu: int, size: int) -> np.ndarray:
        """The aligned block of ``size`` GPUs (``size`` divides S) containing ``gpu``."""
        start = (gpu // size) * size
        return np.arange(start, start + size)

    def replica_max_failed(self, group_failed: np.ndarray) -> np.ndarray:
        """Per replica, the largest number of failed GPUs in any of its stages.

        ``group_failed`` may carry leading batch axes; the last axis is groups.
        """
        shape = group_failed.shape[:-1] + (self.num_replicas, self.pp)
        return group_failed.reshape(shape).max(axis=-1)

    def describe(self) -> str:
        return (f"{self.num_gpus} GPUs, {self.num_domains} x NVL{self.domain_size}, "
                f"TP{self.tp} x PP{self.pp}, {self.num_replicas} DP replicas")
