"""Place vision embeddings at their placeholder tokens (pure function, autograd-friendly).

Shape legend: L = token positions (flattened), H = hidden, M = vision tokens.
"""

from __future__ import annotations

import torch


def merge_vision_embeddings(
    text_embeddings: torch.Tensor, input_ids: torch.Tensor, vision_embeddings: torch.Tensor, *, token_id: int,
    field: str = "image",
) -> torch.Tensor:
    """Replace the embeddings of every `token_id` placeholder with the vision embeddings, in order.

    Args:
        text_embeddings: [L, ..., H], token embeddings in the same order as `input_ids.reshape(-1)`
            along dim 0 (a leading [T, 1, H] for packed THD, or [S*B, H] flattened).
        input_ids: any shape with L elements, the full (not CP-sliced) token ids.
        vision_embeddings: [M, H], one row per placeholder, in token order.

    Returns:
        Embeddings of the same shape with vision rows in place.

    Raises:
        ValueError: M differs from the number of placeholders (naming both counts).
    """
    positions = torch.nonzero(input_ids.reshape(-1) == token_id).flatten()
    if positions.numel() != vision_embeddings.shape[0]:
        raise ValueError(f"{positions.numel()} {field} placeholder tokens (id {token_id}) in input_ids but "
                         f"{vision_embeddings.shape[0]} {field} embeddings from the vision tower")
    rows = vision_embeddings.to(text_embeddings.dtype).reshape(-1, *text_embeddings.shape[1:])
    return text_embeddings.index_copy(0, positions, rows)
