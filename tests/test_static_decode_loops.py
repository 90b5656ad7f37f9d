"""Compiled static-shape decode equal to eager (tests/test_static_decode.py) for the architectures
whose knob is a loop count: SGT, PUT, Dory in both cache modes and HRM-Text. The depth cases are split over
this file and tests/test_static_decode_routers.py so that two test workers compile them side by side."""

from __future__ import annotations

from tests.test_static_decode import depth_case_tests

CASES = ["dory", "dory:last_loop", "hrm_text", "put", "sgt"]

test_compiled_depth_decode_equals_eager_on_a_mixed_depth_batch, \
    test_a_shallow_batch_runs_capped_below_the_deepest_level_and_equals_eager = depth_case_tests(CASES)
