"""What the one-call step layer (native/layer.c ``step_layer_bf16``) is handed, checked before
any C reads it: the kernel indexes the pool with these unchecked. (The layer's outputs against
the op-by-op path, over every kind of step: test_smollm2.py.)"""

from __future__ import annotations

import pytest
import torch

from cleave.runtime.engine.native.args import StepIndex, check_step, stack_tables

BS, BLOCKS = 16, 8


def index(spans: list[tuple[int, int, int]], rows: int = 7, **changed: torch.Tensor
          ) -> StepIndex:
    """Two decodes (rows 0-1, 5 and 9 keys over one block each), then ``spans``' chunks over
    tables of three blocks; ``changed`` replaces any field."""
    fields = {"slots": torch.arange(rows, dtype=torch.int64),
              "tables": torch.tensor([[1], [2]]), "lengths": torch.tensor([5, 9]),
              "spans": torch.tensor(spans, dtype=torch.int64).reshape(-1, 3),
              "chunk_tables": torch.tensor([[3, 4, 5], [6, 7, 0]])[:len(spans)]}
    return StepIndex(**{**fields, **changed})


def test_a_steps_rows_must_be_its_decodes_then_its_chunks_in_order() -> None:
    """Chunks of 3 and 2 rows, the second after 30 tokens of context (two blocks of 16)."""
    assert check_step(index([(2, 3, 0), (5, 2, 30)]), 7, BLOCKS, BS) == 32  # its scratch's keys
    assert check_step(index([], rows=2), 2, BLOCKS, BS) == 0  # a decode-only step
    for spans, why in (([(3, 3, 0), (6, 1, 30)], "start at row 2"),  # a gap after the decodes
                       ([(2, 3, 0), (4, 3, 30)], "start at row 5"),  # chunks overlap
                       ([(2, 3, 0), (5, 2, 47)], "past its block table"),  # 49 keys > 48
                       ([(2, 3, 0), (5, 0, 30)], "start at row 5"),  # an empty chunk
                       ([(2, 3, 0)], "cover 5 of 7 rows")):
        with pytest.raises(ValueError, match=why):
            check_step(index(spans), 7, BLOCKS, BS)


@pytest.mark.parametrize(("changed", "why"), [
    ({"slots": torch.tensor([0, 1, 2, 3, 4, 5, BLOCKS * BS])}, "slot outside"),
    ({"slots": torch.tensor([0, 1, 2, -1, 4, 5, 6])}, "slot outside"),
    ({"tables": torch.tensor([[1], [BLOCKS]])}, "block outside"),
    ({"chunk_tables": torch.tensor([[3, 4, -2], [6, 7, 0]])}, "block outside"),
    ({"lengths": torch.tensor([-1, 9])}, "length outside"),
    ({"slots": torch.arange(6)}, "7 rows, slots"),  # a row without a slot
    ({"tables": torch.tensor([[1]])}, "for 2 decodes"),  # a decode without a table
    ({"chunk_tables": torch.tensor([[3, 4, 5]])}, "chunk tables"),  # a chunk without one
    ({"slots": torch.arange(14)[::2]}, "contiguous"),
    ({"slots": torch.arange(7, dtype=torch.int32)}, "int64"),
])
def test_indices_outside_the_pool_or_out_of_step_are_refused(changed: dict[str, torch.Tensor],
                                                             why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_step(index([(2, 3, 0), (5, 2, 30)], **changed), 7, BLOCKS, BS)


def test_tables_are_checked_before_padding_hides_a_short_one() -> None:
    """Stacked to the widest, a short table's padding would read block 0 for its last keys."""
    short, wide = torch.tensor([4]), torch.tensor([[5, 6, 7]])
    stacked = stack_tables([short, wide], [16, 48], BS)
    assert stacked.tolist() == [[4, 0, 0], [5, 6, 7]] and stacked.is_contiguous()
    with pytest.raises(ValueError, match="past its block table"):
        stack_tables([short, wide], [17, 48], BS)  # 17 keys need two blocks
    assert stack_tables([], [], BS).shape == (0, 0)
