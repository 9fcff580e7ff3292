"""DAPO reward shaping and response masks (arXiv 2503.14476 §3.4; design §7)."""

from __future__ import annotations

import torch

from echotrain.rl.validation import as_bool_mask, check_tensor


def overlong_reward_penalty(
    response_length: torch.Tensor, max_response_length: int, overlong_buffer_len: int
) -> torch.Tensor:
    """DAPO's soft overlong punishment R_length(y) (Eq. 13), ``(B,)`` float32, in [-1, 0].

    With L_max = ``max_response_length`` and L_cache = ``overlong_buffer_len``:
    0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache inside the buffer;
    -1 if |y| > L_max. Measured on the response length alone (never the prompt).

    Args:
        response_length: ``(B,)`` int or float, response tokens of each response.

    Raises:
        ValueError: negative or NaN lengths, L_cache not in (0, L_max].
    """
    check_tensor("response_length", response_length, 1)
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], got {overlong_buffer_len}"
        )
    length = response_length.to(torch.float32)
    if not bool((length >= 0).all()):  # also catches NaN
        raise ValueError("response_length must be >= 0 (and not NaN)")
    start = float(max_response_length - overlong_buffer_len)
    penalty = ((start - length) / overlong_buffer_len).clamp(min=-1.0, max=0.0)
    return torch.where(length > max_response_length, -1.0, penalty)


def truncated_response_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering: zero the loss mask of truncated responses (no EOS), ``(B, T)`` bool.

    Raises:
        ValueError: shape mismatch or non-0/1 inputs.
    """
    mask = as_bool_mask("response_mask", response_mask)
    trunc = as_bool_mask("truncated", truncated)
    if trunc.shape != mask.shape[:1]:
        raise ValueError(f"truncated has shape {tuple(trunc.shape)}, expected ({mask.shape[0]},)")
    return mask & ~trunc.unsqueeze(-1)
