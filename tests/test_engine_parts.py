"""The parts of the engine's start-up and stats that live with the objects they describe: engine
arguments resolved for a device, the scheduler's config from them, the scheduler's queue figures and
the runner's steps ahead (torch-free but for the runner, which needs no model here)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from depthserve.config import EngineArgs
from depthserve.engine.block_manager import BlockManager
from depthserve.engine.model_runner import ModelRunner
from depthserve.engine.scheduler import Scheduler, SchedulerConfig
from depthserve.errors import ConfigurationError
from tests.test_scheduler import make_seq


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_engine_args_on_a_device_take_its_defaults(device_type):
    args = EngineArgs(model="m")
    resolved = args.on_device(device_type)
    assert resolved.max_num_batched_tokens == args.step_token_budget(device_type)
    assert (resolved.long_prefill_token_threshold,
            resolved.long_prefill_context_scale) == args.long_prefill_caps(device_type)
    assert resolved.long_prefill_chunk_tokens == args.long_prefill_chunk(device_type)
    assert None not in (resolved.max_num_batched_tokens, resolved.long_prefill_token_threshold,
                        resolved.long_prefill_chunk_tokens, resolved.long_prefill_context_scale)
    assert resolved.model == "m"


def test_engine_args_on_a_device_keep_what_was_set():
    args = EngineArgs(model="m", max_num_batched_tokens=64, long_prefill_token_threshold=0,
                      long_prefill_context_scale=32)
    resolved = args.on_device("cuda")
    assert (resolved.max_num_batched_tokens, resolved.long_prefill_token_threshold,
            resolved.long_prefill_context_scale) == (64, 0, 32)
    assert args.long_prefill_context_scale == 32 and args is not resolved


def test_scheduler_config_from_engine_args_carries_every_setting():
    args = EngineArgs(model="m", max_num_batched_tokens=96, max_num_seqs=5, long_prefill_token_threshold=40,
                      long_prefill_chunk_tokens=12, long_prefill_context_scale=300,
                      max_long_partial_prefills=2).on_device("cpu")
    config = SchedulerConfig.from_engine_args(args, max_model_len=2048)
    assert config == SchedulerConfig(96, 5, True, long_prefill_token_threshold=40, long_prefill_chunk_tokens=12,
                                     long_prefill_context_scale=300, max_long_partial_prefills=2)


def test_without_chunked_prefill_the_budget_must_hold_the_whole_context():
    args = EngineArgs(model="m", max_num_batched_tokens=256, enable_chunked_prefill=False).on_device("cpu")
    with pytest.raises(ConfigurationError, match="max_num_batched_tokens must be >= max_model_len"):
        SchedulerConfig.from_engine_args(args, max_model_len=257)
    assert not SchedulerConfig.from_engine_args(args, max_model_len=256).enable_chunked_prefill


def _with_compute(seq, relative: float):
    seq.plan = replace(seq.plan, flops_per_token=relative * 100.0, plain_flops_per_token=100.0)
    return seq


def test_queue_stats_and_mean_relative_compute_count_the_running_sequences():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2), BlockManager(64, 4, True))
    assert scheduler.queue_stats() == {"num_running": 0, "num_waiting": 0, "num_running_requests": 0,
                                       "num_preemptions": 0}
    assert scheduler.mean_relative_compute() == 1.0  # nothing runs: the model's default depth
    for seq in (_with_compute(make_seq("a", 3, 4), 0.5), _with_compute(make_seq("a", 3, 4), 0.25),
                _with_compute(make_seq("b", 3, 4), 2.0)):
        scheduler.add(seq)
    scheduler.schedule()  # max_num_seqs 2: both sequences of request "a" run, "b" waits
    assert scheduler.queue_stats() == {"num_running": 2, "num_waiting": 1, "num_running_requests": 1,
                                       "num_preemptions": 0}
    assert scheduler.mean_relative_compute() == pytest.approx(0.375)


class _Static:
    steps_ahead = 4


@pytest.mark.parametrize("can_run_ahead, expected", [(True, 4), (False, 1)])
def test_the_runner_runs_ahead_only_batches_that_may(monkeypatch, can_run_ahead, expected):
    runner = object.__new__(ModelRunner)  # the method reads only `static` and `can_run_ahead`
    runner.static = _Static()
    monkeypatch.setattr(ModelRunner, "can_run_ahead", lambda self, batch: can_run_ahead)
    assert runner.max_steps_ahead([]) == expected
