"""Prefix-aware routing of engine calls across engine replicas (a Ray Serve request router).

An engine replica's prefix cache holds the KV pages of the prompt blocks it has computed (full
blocks of `block_tokens` tokens, keyed by the chain of blocks before them: docs/server.md, "Prefix
caching"). A prompt whose leading blocks another replica computed gets nothing from that cache, so
the router remembers which replica last took each block chain and sends a call to the replica that
holds the longest run of its leading blocks, unless that replica has `max_imbalance` more calls in
flight than the least busy one; a call with no known prefix goes to the least busy replica (Serve
probes the queue lengths of a rank's replicas and takes the shortest). What this buys in prefix-cache
hits is measured in docs/benchmarks.md, "Ray Serve replicas".

The memory is this router's own: each ingress replica (each handle) learns from the calls it routes;
it holds at most `max_blocks` chains, the least recently routed dropped first, and forgets a replica
when Serve reports its actor dead.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from depthserve.deploy.remote_engine import EngineCall, ReplicaTarget


def block_chain_keys(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """One key per full leading block: key i identifies blocks 0..i together."""
    keys, key = [], 0
    for end in range(block_tokens, len(token_ids) + 1, block_tokens):
        key = hash((key, tuple(token_ids[end - block_tokens:end])))
        keys.append(key)
    return keys


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve routes pending calls first in, first out: each routing round takes the oldest call, asks
    this router for its ranks of replicas and gives that call the replica chosen. (Without the FIFO
    order, Ray Serve 2.58's per-call matching left calls unrouted while its queue-length probes piled
    up on the replicas: measured with two replicas and six concurrent calls.)"""

    def initialize_state(self, block_tokens: int = 16, max_blocks: int = 200_000, max_imbalance: int = 4,
                         prefix_affinity: bool = True) -> None:
        self.block_tokens, self.max_blocks, self.max_imbalance = block_tokens, max_blocks, max_imbalance
        self.prefix_affinity = prefix_affinity  # False: every call to the least busy replica
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        self._in_flight: Counter[ReplicaID] = Counter()
        self._calls: dict[str, ReplicaID] = {}  # internal request id -> its replica, while in flight

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        arg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if pending_request is not None:
            # every candidate is in the ranks returned: when none takes the call, Serve must back off
            # before asking again (it asks again at once otherwise, and spins)
            pending_request.routing_context.should_backoff = True
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        if isinstance(arg, ReplicaTarget):
            wanted = next((r for r in candidate_replicas if r.replica_id.unique_id == arg.replica), None)
            # a replica that is gone: any other answers the call and says it is not the target
            return [[wanted]] if wanted is not None else [candidate_replicas]
        if isinstance(arg, EngineCall) and self.prefix_affinity:
            owner = self.prefix_owner(arg.token_ids, by_id)
            if owner is not None:
                least = min(self._in_flight[r] for r in by_id)
                if self._in_flight[owner] - least <= self.max_imbalance:
                    return [[by_id[owner]], [r for r in candidate_replicas if r.replica_id != owner]]
        return [candidate_replicas]

    def prefix_owner(self, token_ids: Sequence[int], replicas: dict[ReplicaID, RunningReplica]) -> ReplicaID | None:
        """The live replica that took the longest leading block chain of these tokens, if any."""
        for key in reversed(block_chain_keys(token_ids, self.block_tokens)):
            owner = self._owner.get(key)
            if owner is not None and owner in replicas:
                return owner
        return None

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._in_flight[replica_id] += 1
        self._calls[pending_request.metadata.internal_request_id] = replica_id
        arg = pending_request.args[0] if pending_request.args else None
        if isinstance(arg, EngineCall) and self.prefix_affinity:
            for key in block_chain_keys(arg.token_ids, self.block_tokens):
                self._owner[key] = replica_id
                self._owner.move_to_end(key)
            while len(self._owner) > self.max_blocks:
                self._owner.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._calls.pop(internal_request_id, None) is not None and self._in_flight[replica_id] > 0:
            self._in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
        for key in [k for k, owner in self._owner.items() if owner == replica_id]:
            del self._owner[key]
