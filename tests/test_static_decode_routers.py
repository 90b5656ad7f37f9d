"""Compiled static-shape decode equal to eager (tests/test_static_decode.py) for the architectures
with routers, experts or a bias update: ITT, Dreamer, SAOBP and Inkling-2 (a loop count too, and
routed experts). The depth cases are split over
this file and tests/test_static_decode_loops.py so that two test workers compile them side by side."""

from __future__ import annotations

from tests.test_static_decode import depth_case_tests

CASES = ["dreamer", "inkling2_loop_text", "itt", "saobp"]

test_compiled_depth_decode_equals_eager_on_a_mixed_depth_batch, \
    test_a_shallow_batch_runs_capped_below_the_deepest_level_and_equals_eager = depth_case_tests(CASES)
