"""PoolStorage: the bytes of the page pool on the device (plus one scratch page that padded graph rows write
into) and the host pages that paused requests' KV is swapped to.

One PoolStorage serves every model of an engine: each model's runner views the same bytes through its own
KVLayout (its tokens per page), so a page id means the same bytes to all of them, and a swap copies whole
byte pages whatever model they belong to. The swap copies run on one copy stream, in order, for all models.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from dflash2.engine.transfer import to_device


class PoolStorage:
    def __init__(self, num_pages: int, page_bytes: int, num_host_pages: int, device: torch.device) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.device = device
        self.scratch_page = num_pages
        self.pool_bytes = torch.zeros((num_pages + 1) * page_bytes, dtype=torch.uint8, device=device)
        self.device_pages = self.pool_bytes.view(num_pages + 1, page_bytes)
        self.host_pages = torch.empty((num_host_pages, page_bytes), dtype=torch.uint8,
                                      pin_memory=device.type == "cuda")
        # the swap copies between host and device pages run on their own stream (swap)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copies_done(self) -> Callable[[], None] | None:
        """A wait for the copies queued so far on the copy stream (None on the CPU: they are done)."""
        if self.copy_stream is None:
            return None
        return self.copy_stream.record_event().synchronize

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy paused requests' pages to host pages and resumed ones back, queued before the step's
        kernels (so a page freed by a swap-out is read before anything new is written into it).

        Every source page is read before any destination page is written: one plan may hand a host page
        freed by a swap-in to a later swap-out, or a device page freed by a swap-out to a later swap-in, in
        either order (a request is never both paused and resumed in one plan, so no source is itself a
        destination of the same plan). On the GPU, with no host sync:

            in:  host pages (pinned) --runs, copy stream--> staging (device) --index_copy_, main--> device pages
            out: device pages --index_select, main--> staging (device) --runs, copy stream--> host pages (pinned)

        one gather or scatter kernel per direction on the main stream, and one async copy per run of
        consecutive host pages on the copy stream (pairs are sorted by host page, so the staging rows of a run
        are consecutive too). The copy stream is in order: a swap-in's copies come after every earlier
        swap-out's copies to the host (it may read those host pages), and this plan's swap-out copies come
        after its swap-in copies (they may write host pages the swap-in reads). The swap-in's copies are
        issued at once, so with overlap they run while the step before this one computes; only the scatter
        waits for them. The swap-out's copies wait for the gather, and the step's kernels may write the freed
        device pages as soon as the gather has read them.
        """
        if not swap_out and not swap_in:
            return
        swap_out = sorted(swap_out, key=lambda pair: pair[1])
        swap_in = sorted(swap_in)
        if self.device.type != "cuda":
            out_pages = self.device_pages[[d for d, _ in swap_out]]  # advanced indexing copies: read first
            in_pages = self.host_pages[[h for h, _ in swap_in]]
            self.host_pages[[h for _, h in swap_out]] = out_pages
            self.device_pages[[d for _, d in swap_in]] = in_pages
            return
        main, side = torch.cuda.current_stream(self.device), self.copy_stream
        in_copied = None
        if swap_in:
            with torch.cuda.stream(side):  # behind earlier swap-outs' host copies (the stream is in order)
                # allocated on the copy stream: the allocator never hands it memory that kernels queued on
                # the main stream may still use (a block freed there is reused in stream order only)
                in_staging = torch.empty((len(swap_in), self.device_pages.shape[1]), dtype=torch.uint8,
                                         device=self.device)
                for row, host_page, count in _runs([h for h, _ in swap_in]):
                    in_staging[row:row + count].copy_(self.host_pages[host_page:host_page + count],
                                                      non_blocking=True)
            in_copied = side.record_event()
        if swap_out:
            out_staging = self.device_pages.index_select(0, to_device([d for d, _ in swap_out], torch.long,
                                                                      self.device))
            side.wait_stream(main)  # after the gather (and this plan's swap-in copies, already ahead on side)
            with torch.cuda.stream(side):
                for row, host_page, count in _runs([h for _, h in swap_out]):
                    self.host_pages[host_page:host_page + count].copy_(out_staging[row:row + count],
                                                                       non_blocking=True)
            out_staging.record_stream(side)  # not reused by the allocator before these copies end
        if in_copied is not None:
            main.wait_event(in_copied)  # the scatter (and so the step's kernels) after the copies to staging
            self.device_pages.index_copy_(0, to_device([d for _, d in swap_in], torch.long, self.device),
                                          in_staging)
            in_staging.record_stream(main)  # not reused on the copy stream before the scatter has read it


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive page ids in a sorted list: (index of the first, first page id, length)."""
    runs: list[tuple[int, int, int]] = []
    for index, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            row, first, count = runs[-1]
            runs[-1] = (row, first, count + 1)
        else:
            runs.append((index, page, 1))
    return runs
