"""The context-length rule (depthserve/engine/context_length.py): one function, two modes. The
server refuses a prompt + max_tokens past the context; the offline API cuts max_tokens to fit."""

from __future__ import annotations

import pytest

from depthserve.engine.context_length import ContextOverflow, completion_budget
from depthserve.errors import InvalidRequestError, PromptTooLongError

REFUSE, CLAMP = ContextOverflow.REFUSE, ContextOverflow.CLAMP


@pytest.mark.parametrize("overflow", [REFUSE, CLAMP])
def test_within_the_context_both_modes_grant_max_tokens_or_the_rest(overflow):
    assert completion_budget(10, 6, 16, overflow) == 6
    assert completion_budget(10, None, 16, overflow) == 6  # None: the rest of the context
    assert completion_budget(10, 0, 16, overflow) == 0
    assert completion_budget(16, 0, 16, overflow) == 0  # a prompt that fills the context is scored
    assert completion_budget(16, None, 16, overflow) == 0


@pytest.mark.parametrize("overflow", [REFUSE, CLAMP])
def test_a_prompt_past_the_context_or_filling_it_with_output_asked_is_refused_in_both_modes(overflow):
    with pytest.raises(PromptTooLongError, match="context"):
        completion_budget(17, 0, 16, overflow)
    with pytest.raises(PromptTooLongError, match="context"):
        completion_budget(17, None, 16, overflow)
    with pytest.raises(PromptTooLongError, match="context"):
        completion_budget(16, 1, 16, overflow)


def test_past_the_context_the_server_refuses_and_names_the_limit():
    with pytest.raises(PromptTooLongError) as refused:
        completion_budget(10, 7, 16, REFUSE)
    assert isinstance(refused.value, InvalidRequestError) and refused.value.status == 400
    assert "maximum context length is 16 tokens" in str(refused.value) and "asks for 17" in str(refused.value)
    with pytest.raises(PromptTooLongError, match="maximum context length"):
        completion_budget(1, 2**64, 16, REFUSE)


def test_past_the_context_the_offline_api_clamps_max_tokens():
    assert completion_budget(10, 7, 16, CLAMP) == 6
    assert completion_budget(1, 2**64, 16, CLAMP) == 15
