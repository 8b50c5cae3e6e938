"""What the engine trains: a causal LM shard whose loss is computed over vocab-sharded logits.

`CausalLMShard` holds what every model family shares (the own `Llama` and transformers' models alike): the mean
next-token loss, its (sum, count) form, and the sharding of every parameter by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ntp_ds.layout.shard_layout import ParamSpec
from ntp_ds.models.tp_layers import VocabParallelEmbedding, gather_vocab, vocab_parallel_cross_entropy


class CausalLMShard(nn.Module):
    """Base of the model shards: subclasses set `config`, `layout`, `tp_rank`, `tp_group` and define `logits`."""

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Return the local vocab-shard logits [batch, seq, local_vocab]."""
        raise NotImplementedError

    def embedding(self) -> VocabParallelEmbedding:
        """Return the vocab-parallel input embedding (its index table maps token ids to local rows)."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                full_logits: bool = False) -> torch.Tensor:
        """Return the local vocab-shard logits, with `full_logits` the whole vocabulary's (gathered over the TP
        group, for a loss function of the caller's own), or with labels the mean next-token loss."""
        if full_logits:
            if labels is not None:
                raise ValueError("full_logits=True returns logits for the caller's own loss: pass no labels")
            return gather_vocab(self.logits(input_ids), self.embedding().local_index, self.tp_group)
        if labels is None:
            return self.logits(input_ids)
        total, count = self.loss_sum(input_ids, labels)
        return total / count

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (summed loss, counted tokens) of predicting labels[t + 1] at t, skipping labels equal to -100."""
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        return vocab_parallel_cross_entropy(self.logits(input_ids), shifted, self.layout, self.tp_rank,
                                            self.tp_group, table=self.embedding().local_index)

    def param_specs(self) -> dict[str, tuple[ParamSpec, tuple[int, ...]]]:
        """Map every parameter name to how it is sharded and its full (unsharded) shape.

        TP layers say so in their `shard_specs`; every other parameter is replicated.
        """
        out = {}
        for name, p in self.named_parameters():
            owner, _, attr = name.rpartition(".")
            specs = getattr(self.get_submodule(owner), "shard_specs", None)
            out[name] = specs[attr] if specs else (ParamSpec("replicated"), tuple(p.shape))
        return out

    def set_tp_group(self, group) -> None:
        """Run the shard's TP collectives on `group` from now on: a recovery keeps a shard whose replica's TP group it
        replaces (None in between, so that nothing of the shard holds the old group open). Every module attribute
        that held the group the shard was built with follows it; hooks read it from the shard."""
        holders = self.__dict__.get("_tp_holders")
        if holders is None:
            if self.tp_group is None:  # built without one: a TP 1 shard, whose modules run no TP collective
                if group is not None and self.layout.tp > 1:
                    raise RuntimeError(f"set_tp_group: a tp={self.layout.tp} shard was built without a TP group")
                return
            # Names, not modules: a list of its own submodules would make the shard a reference cycle, freed only by
            # a full garbage collection.
            holders = self.__dict__["_tp_holders"] = [
                (name, attr) for name, module in self.named_modules() for attr in ("tp_group", "group")
                if vars(module).get(attr) is self.tp_group]
        for name, attr in holders:
            setattr(self.get_submodule(name), attr, group)

    def check_runnable(self) -> None:
        if self.layout.tp > 1 and self.tp_group is None:
            raise RuntimeError(f"a shard of a tp={self.layout.tp} layout needs its tp_group to run")
