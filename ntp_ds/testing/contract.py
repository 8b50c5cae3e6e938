"""Check recorded wire calls (`ntp_ds.comm.wire.recording`) of every rank against what NCCL requires.

- Every tensor of a call lives on its group's device type (CUDA for NCCL, CPU for gloo).
- Point-to-point messages match without tags: the k-th message rank A posts to rank B has the size of the k-th
  receive B posts from A, and every send has a receive.
- A pairwise exchange is posted in one batch on both sides: when A's message to B and B's message to A belong to
  matching calls, each of those calls posts both directions (a send posted before its receive, in separate calls,
  can deadlock NCCL on large messages).
- A step commits only once the device has done its work: every `commit_vote` follows a `settle_device` made since the
  step's `ready_vote` (NCCL's host passes a collective once it is queued, so without the settle a rank could vote a
  step whose all-gather never completed).
"""

from __future__ import annotations

from collections import defaultdict


def check_calls(records_by_rank: dict[int, list]) -> list[str]:
    """Return every violation found in the records (empty when the calls keep the rules)."""
    problems = []
    sends, recvs = defaultdict(list), defaultdict(list)  # (src, dst) -> [(call index, numel)]
    for rank, records in records_by_rank.items():
        for i, rec in enumerate(records):
            for device in rec.devices:
                if not device.startswith(rec.expected_device):
                    problems.append(f"rank {rank} call {i} ({rec.op}, {rec.backend}): a tensor on {device}, "
                                    f"group device {rec.expected_device}")
            for peer, numel in rec.sends:
                sends[(rank, peer)].append((i, numel))
            for peer, numel in rec.recvs:
                recvs[(peer, rank)].append((i, numel))
    for rank, records in records_by_rank.items():
        settled = True
        for i, rec in enumerate(records):
            if rec.op == "ready_vote":
                settled = False
            elif rec.op == "settle_device":
                settled = True
            elif rec.op == "commit_vote" and not settled:
                problems.append(f"rank {rank} call {i}: commit_vote without settle_device since the ready_vote")
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if [n for _, n in s] != [n for _, n in r]:
            problems.append(f"messages {src}->{dst}: sent sizes {[n for _, n in s]} but receives posted for "
                            f"{[n for _, n in r]}")
            continue
        back_s, back_r = sends.get((dst, src), []), recvs.get((dst, src), [])
        for (send_call, _), (recv_call, _) in zip(s, r):
            # The call at dst that receives this message also sends back to src: src must receive that reply in
            # the very call that sent, or the two sides post their sends first and wait on each other.
            if any(call == recv_call for call, _ in back_s):
                if not any(call == send_call for call, _ in back_r):
                    problems.append(f"rank {src} call {send_call} sends to {dst} whose matching call {recv_call} "
                                    f"sends back, but rank {src} does not receive it in the same batch")
    return problems
