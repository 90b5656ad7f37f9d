"""The confidence exit (depth policy `confidence`, docs/depth-semantics.md section 6), driven by
per-level readouts: for a model whose every depth level's state can be read out by its LM head
(DepthModel.readout_every_level), a token whose readout is sampled stops at the first level of its
range, below its own level, at which the readout gives its top-1 next token at least its request's
exit probability (BatchItem.exit_threshold). With prompt tokens by need, a prompt token whose next
token is in the prompt stops at the first such level whose readout gives that known token at least
the exit probability (BatchItem.prompt_next_tokens). A constrained request's readout is masked first
(BatchItem.allowed_tokens), so its confidence is that of the distribution it will sample from.

Only eager steps exit early: a step with an exit threshold runs a range knob's level, which the
static decode step never does, so `NoExit` stands in there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from depthserve.layers.batch import StepBatch
from depthserve.structured.bitmask import apply_token_bitmask_


class LevelExit:
    """Each row's level, lowered where a token exits early; the readouts that cost."""

    levels: np.ndarray | torch.Tensor  # [step rows] the level each row runs to (narrow's values)

    def check(self, readout: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: np.ndarray | None,
              level: int) -> None:
        """After `level` (x: the states of the step's packed `rows`, None: all), lower the levels of
        the rows confident enough to stop there."""

    def readouts(self, device: torch.device) -> torch.Tensor:
        """[step rows] int32 readouts each row took beside its final one."""
        raise NotImplementedError

    def finish(self) -> None:
        """Report the level each token ran at, for the items whose tokens may have stopped early."""


class NoExit(LevelExit):
    def __init__(self, levels: torch.Tensor):
        self.levels = levels

    def readouts(self, device: torch.device) -> torch.Tensor:
        return torch.zeros_like(self.levels, dtype=torch.int32)


class ConfidenceExit(LevelExit):
    """The confidence exit of one eager step: the token of an item with an exit threshold whose
    readout is sampled (the step's last token, when its sequence samples after the step) may stop
    at any level from its range's minimum up, below its own level."""

    def __init__(self, step: StepBatch, levels: np.ndarray):
        self.step = step
        self.levels = levels.astype(np.int64)  # a copy, lowered as tokens exit
        self.threshold = np.full(step.num_rows, np.nan)
        lowest = np.zeros(len(step.items), np.int64)
        for i, item in enumerate(step.items):
            if item.exit_threshold is not None and item.samples:
                self.threshold[item.row + item.num_tokens - 1] = item.exit_threshold
            if item.plan.elastic is not None:
                lowest[i] = item.plan.elastic.minimum
        self.lowest = lowest[step.item_of_row()]
        # Prompt tokens by need: the prompt's next token of each such row, whose readout probability
        # (not the top-1's) decides; -1 elsewhere.
        self.teacher = np.full(step.num_rows, -1, np.int64)
        for item in step.items:
            if item.exit_threshold is not None and item.prompt_next_tokens is not None:
                rows = item.row + np.flatnonzero(item.prompt_next_tokens >= 0)
                self.threshold[rows] = item.exit_threshold
                self.teacher[rows] = item.prompt_next_tokens[rows - item.row]
        self._readouts = np.zeros(step.num_rows, dtype=np.int32)
        # Rows of constrained requests: their readout is masked to the tokens the constraint allows.
        self.allowed = {item.row + item.num_tokens - 1: item.allowed_tokens for item in step.items
                        if item.allowed_tokens is not None and item.exit_threshold is not None}

    def check(self, readout: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: np.ndarray | None,
              level: int) -> None:
        rows = np.arange(self.step.num_rows) if rows is None else rows
        asks = ~np.isnan(self.threshold[rows]) & (self.lowest[rows] <= level) & (level < self.levels[rows])
        if not asks.any():
            return
        at = np.flatnonzero(asks)
        logits = readout(x.index_select(0, torch.from_numpy(at).to(x.device)))
        masked = [(j, self.allowed[row]) for j, row in enumerate(rows[at].tolist()) if row in self.allowed]
        if masked:
            apply_token_bitmask_(logits, torch.stack([mask for _, mask in masked]), [j for j, _ in masked])
        probs = torch.softmax(logits, dim=-1)
        teacher = self.teacher[rows[at]]
        known = torch.from_numpy(np.maximum(teacher, 0)).to(probs.device)[:, None]
        chance = torch.where(torch.from_numpy(teacher >= 0).to(probs.device),
                             probs.gather(1, known)[:, 0], probs.amax(dim=-1))
        confident = chance.cpu().numpy() >= self.threshold[rows[at]]
        self._readouts[rows[at]] += 1
        self.levels[rows[at[confident]]] = level

    def readouts(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self._readouts).to(device)

    def finish(self) -> None:
        owner = self.step.item_of_row()
        for i, item in enumerate(self.step.items):
            if item.exit_threshold is not None:
                self.step.ran_levels[i] = self.levels[owner == i].tolist()
