"""The Ray Serve ingress's engine client and router without a cluster (depthserve/deploy/remote_engine.py,
prefix_router.py): a call whose replica dies before any output is sent again, one that dies after
it ends with a typed 503, the engine's typed errors come back as they were raised, a refused prompt
cancels the request's other prompts; the router keeps a prompt's leading blocks on the replica that
took them unless that replica is too busy. The same behaviour on a live cluster: test_ray_serve.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra depthserve[ray]")

from ray.exceptions import ActorDiedError, RayTaskError  # noqa: E402
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402

from depthserve.deploy.prefix_router import PrefixAffinityRouter, block_chain_keys  # noqa: E402
from depthserve.deploy.remote_engine import (SERVED_BY, Admitted, EngineCall, RemoteEngine,  # noqa: E402
                                             ReplicaLostError, ReplicaReport, ReplicaTarget, merged_stats)
from depthserve.engine.context_length import ContextOverflow  # noqa: E402
from depthserve.errors import EngineDeadError, PromptTooLongError  # noqa: E402
from depthserve.sampling_params import SamplingParams  # noqa: E402


class Responses:
    """A streaming Serve response: the scripted items in turn (an exception is raised when reached)."""

    def __init__(self, items: list):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """A Serve handle to the engine deployment whose generate calls answer from `script`, in turn."""

    def __init__(self, script: list[list]):
        self.script, self.calls = list(script), []
        self.generate = SimpleNamespace(remote=self._generate)

    def options(self, stream: bool):
        assert stream
        return self

    def _generate(self, call: EngineCall) -> Responses:
        self.calls.append(Responses(self.script.pop(0)))
        return self.calls[-1]


def admitted(replica: str) -> Admitted:
    return Admitted(ReplicaReport(replica, True, "ok", {"num_running": 1}))


def output(text: str) -> SimpleNamespace:
    return SimpleNamespace(text=text)


def engine(script: list[list]) -> RemoteEngine:
    return RemoteEngine(Handle(script), model_info=SimpleNamespace(name="m"))


async def collect(remote: RemoteEngine, prompts: int = 1) -> tuple[list[list[str]], list[str]]:
    served: list[str] = []
    SERVED_BY.set(served)
    streams = await remote.add_requests([[1, 2, 3]] * prompts, SamplingParams(), None,
                                        [f"r-{i}" for i in range(prompts)], ContextOverflow.REFUSE)
    texts = []
    for stream in streams:
        texts.append([out.text async for out in stream])
    return texts, served


def test_a_call_whose_replica_dies_before_any_output_is_sent_again():
    remote = engine([[admitted("a"), ActorDiedError()], [admitted("b"), output("x"), output("xy")]])
    texts, served = asyncio.run(collect(remote))
    assert texts == [["x", "xy"]] and served == ["a", "b"]
    assert remote.is_healthy and remote.stats()["num_running"] == 2  # both replicas' reports, summed


def test_a_stream_whose_replica_dies_after_output_ends_with_a_typed_503():
    remote = engine([[admitted("a"), output("x"), ActorDiedError()]])
    seen = []

    async def run():
        [stream] = await remote.add_requests([[1]], SamplingParams(), None, ["r"], ContextOverflow.REFUSE)
        async for out in stream:
            seen.append(out.text)

    with pytest.raises(ReplicaLostError, match="replica a") as info:
        asyncio.run(run())
    assert seen == ["x"] and info.value.status == 503 and info.value.error_type == "service_unavailable"


def test_the_engines_typed_errors_come_back_unwrapped_and_refusal_cancels_the_other_prompts():
    refused = PromptTooLongError("the prompt has 5000 tokens; the model's context is 2048")
    remote = engine([[admitted("a"), output("x")], [RayTaskError("generate", "traceback", refused)]])
    with pytest.raises(PromptTooLongError) as info:
        asyncio.run(collect(remote, prompts=2))
    assert str(info.value) == str(refused) and info.value.status == 400
    assert remote._handle.calls[0].cancelled  # the admitted first prompt is aborted on its replica


def test_when_every_attempt_loses_its_replica_the_request_gets_engine_dead():
    remote = engine([[ActorDiedError()]] * 3)
    with pytest.raises(EngineDeadError, match="3 tried"):
        asyncio.run(collect(remote))


def test_health_reflects_the_replicas_reports():
    remote = engine([])
    assert not remote.is_healthy and "no engine replica reported" in remote.health_message()
    remote._take_report(ReplicaReport("a", False, "the engine loop stopped", {}))
    assert not remote.is_healthy and "engine replica a: the engine loop stopped" in remote.health_message()
    remote._take_report(ReplicaReport("b", True, "ok", {}))
    assert remote.is_healthy and remote.health_message() == "ok"


def test_reports_are_asked_of_every_replica_heard_from_and_silent_ones_are_forgotten():
    asked = []

    async def report(target):
        asked.append(target)
        return ReplicaReport("a" if target is None else target.replica, True, "ok", {})

    remote = RemoteEngine(SimpleNamespace(report=SimpleNamespace(remote=report)), model_info=None, forget_after_s=30)
    remote._take_report(ReplicaReport("b", True, "ok", {}))
    asyncio.run(remote.poll_reports())
    assert asked == [None, ReplicaTarget("b")] and set(remote._reports) == {"a", "b"}
    remote._reports["b"] = ReplicaReport("b", True, "ok", {}, at=remote._reports["b"].at - 31)
    asked.clear()
    asyncio.run(remote.poll_reports())
    assert asked == [None, ReplicaTarget("a")] and set(remote._reports) == {"a"}


def test_replica_stats_merge_as_one_engines():
    a = {"num_running": 2, "kv_bytes_used_by_kind": {"kv": 10}, "mean_relative_compute": 1.0,
         "depth_policy": "slo", "depth_policy_target": 2, "depth_levels_run": {1: 3}}
    b = {"num_running": 1, "kv_bytes_used_by_kind": {"kv": 5, "conv": 1}, "mean_relative_compute": 0.5,
         "depth_policy": "slo", "depth_policy_target": 4, "depth_levels_run": {1: 1, 2: 2}}
    assert merged_stats([a, b]) == {
        "num_running": 3, "kv_bytes_used_by_kind": {"kv": 15, "conv": 1}, "mean_relative_compute": 0.75,
        "depth_policy": "slo", "depth_policy_target": 4, "depth_levels_run": {1: 4, 2: 2}}


# ---- the router ------------------------------------------------------------------------------------
def replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name, DeploymentID(name="engine", app_name="app")))


def pending(arg, request_id: str = "q") -> SimpleNamespace:
    return SimpleNamespace(args=[arg], metadata=SimpleNamespace(internal_request_id=request_id),
                           routing_context=SimpleNamespace(should_backoff=False))


def router(**kwargs) -> PrefixAffinityRouter:
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the routing state alone, no Serve controller
    r.initialize_state(**kwargs)
    return r


def call(tokens: list[int]) -> EngineCall:
    return EngineCall("r", tokens, SamplingParams(), None, ContextOverflow.REFUSE)


def test_block_chain_keys_follow_the_shared_leading_blocks():
    a, b = list(range(40)), list(range(32)) + [99] * 8
    assert block_chain_keys(a, 16)[:2] == block_chain_keys(b, 16)[:2]  # two full blocks in common
    assert len(block_chain_keys(a, 16)) == 2 and block_chain_keys(a[:15], 16) == []
    assert block_chain_keys(a, 8)[4] != block_chain_keys(b, 8)[4]


def test_the_router_sends_a_known_prefix_to_its_replica_unless_it_is_too_busy():
    r, (one, two) = router(block_tokens=4, max_imbalance=1), (replica("one"), replica("two"))
    system = list(range(12))
    first = asyncio.run(r.choose_replicas([one, two], pending(call(system + [50, 51]))))
    assert first == [[one, two]]  # unknown prefix: one rank, Serve takes the shorter queue
    r.on_request_routed(pending(call(system + [50, 51]), "q1"), two.replica_id, None)
    ranks = asyncio.run(r.choose_replicas([one, two], pending(call(system + [60, 61, 62, 63]))))
    assert ranks == [[two], [one]]
    r.on_request_routed(pending(call([7] * 8), "q2"), two.replica_id, None)  # two now has 2 in flight
    assert asyncio.run(r.choose_replicas([one, two], pending(call(system)))) == [[one, two]]
    r.on_request_completed(two.replica_id, "q2")
    assert asyncio.run(r.choose_replicas([one, two], pending(call(system))))[0] == [two]
    assert asyncio.run(r.choose_replicas([one], pending(call(system)))) == [[one]]  # two is gone


def test_least_loaded_routing_ignores_prefixes():
    r, (one, two) = router(block_tokens=4, prefix_affinity=False), (replica("one"), replica("two"))
    r.on_request_routed(pending(call(list(range(12))), "q1"), two.replica_id, None)
    assert asyncio.run(r.choose_replicas([one, two], pending(call(list(range(12)))))) == [[one, two]]


def test_a_targeted_call_goes_to_its_replica():
    r, (one, two) = router(), (replica("one"), replica("two"))
    assert asyncio.run(r.choose_replicas([one, two], pending(ReplicaTarget("two")))) == [[two]]
    assert asyncio.run(r.choose_replicas([one], pending(ReplicaTarget("two")))) == [[one]]


def test_an_engine_replica_whose_engine_died_fails_serves_health_check():
    """Serve replaces a replica whose check_health raises (test_ray_serve.py: a replaced replica)."""
    from depthserve.deploy.ray_serve import engine_class

    class Replica(engine_class()):
        def __del__(self):  # Serve awaits the real one (async) at shutdown; nothing to stop here
            pass

    replica = Replica.__new__(Replica)
    replica.replica = "r1"
    replica.llm = SimpleNamespace(is_healthy=True, health_message=lambda: "ok")
    asyncio.run(replica.check_health())
    replica.llm = SimpleNamespace(is_healthy=False, health_message=lambda: "the engine loop stopped on a fault")
    with pytest.raises(RuntimeError, match="replica r1 is down: the engine loop stopped on a fault"):
        asyncio.run(replica.check_health())
    assert asyncio.run(replica.reset_prefix_cache(ReplicaTarget("r2"))) is False  # not the target: nothing reset
