"""What one put may cost in bytes: its footprint, not only its block count.

A put is laid out as one extent per (layer, head), each 4 KiB-aligned, so it is staged
and written as ``layers x heads x align_up(pages x block_bytes)`` bytes, its footprint.
With tiny blocks that is far more than what the client sent: 4-byte blocks (head dim 1,
page size 1) on 256 x 256 (layer, head) pairs make one page of 256 KiB a footprint of
256 MiB. :func:`check_put_bytes` refuses such a put before anything is staged:

- a footprint past :data:`MAX_PADDING` times the payload and past
  :data:`PADDING_SLACK_BYTES` (a decode step of one small page per (layer, head) pads
  each block to 4 KiB but stays far below the slack);
- a footprint past :data:`MAX_PUT_BYTES`, whatever the payload, as that much is staged
  in memory before it is written.
"""

from __future__ import annotations

from kvdrive.layout import align_up
from kvstored.config import format_size
from kvstored.protocol import ErrorCode, ProtocolError

MAX_PADDING = 16  # footprint / payload
PADDING_SLACK_BYTES = 64 << 20  # any put may have this footprint, whatever its padding
MAX_PUT_BYTES = 4 << 30


def put_footprint(num_extents: int, num_pages: int, block_bytes: int) -> int:
    """Bytes a put of ``num_extents`` (layer, head) extents of ``num_pages`` blocks stages and writes."""
    return num_extents * align_up(num_pages * block_bytes)


def check_put_bytes(num_extents: int, num_pages: int, block_bytes: int) -> None:
    """Refuse (``too_large``) a put whose footprint is out of bounds (see the module)."""
    payload = num_extents * num_pages * block_bytes
    footprint = put_footprint(num_extents, num_pages, block_bytes)
    if footprint > MAX_PUT_BYTES:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"put of {format_size(footprint)} on the SSD, limit {format_size(MAX_PUT_BYTES)} per put: "
            "split it by layers or pages",
        )
    if footprint > max(MAX_PADDING * payload, PADDING_SLACK_BYTES):
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"put of {format_size(payload)} in {num_extents} (layer, head) extents of {num_pages} page(s) takes "
            f"{format_size(footprint)} on the SSD, each extent aligned to 4 KiB; limit {MAX_PADDING}x its payload "
            f"past {format_size(PADDING_SLACK_BYTES)}: put more pages at a time, or use larger blocks",
        )
