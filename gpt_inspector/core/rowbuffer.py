"""The CPU buffers a recorder keeps its per-layer rows in (q, head outputs, K/V mirrors, biases)."""

from __future__ import annotations

import torch

# a buffer grows by a quarter of what it holds (at least _GROW positions): each position is
# re-copied a bounded number of times (≤ 4 on average) at any T, and capacity stays ≤ 1.25x + _GROW
_GROW = 64


class RowBuffer:
    """A (B, H, capacity, d) CPU tensor that grows along positions."""

    def __init__(self) -> None:
        self._t: torch.Tensor | None = None
        # rows copied from an accelerator, not yet placed: (contiguous pinned block, start, its device)
        self._staged: list[tuple[torch.Tensor, int, torch.device]] = []

    @property
    def t(self) -> torch.Tensor | None:
        if self._staged:
            self._settle()
        return self._t

    def write(self, rows: torch.Tensor, start: int) -> None:
        # rows: (B, H, n, d), possibly on an accelerator
        b, h, n, d = rows.shape
        end = start + n
        t = self._t
        if (
            t is None
            or t.shape[0] != b
            or t.shape[1] != h
            or t.shape[3] != d
            or t.shape[2] < end
            or t.dtype != rows.dtype
        ):
            t = self.t  # what is staged lands first
            held = t.shape[2] if t is not None else 0
            cap = max(end, held) + max(_GROW, max(end, held) // 4)
            new = torch.empty((b, h, cap, d), dtype=rows.dtype)
            if t is not None and t.shape[0] == b and t.shape[1] == h and t.shape[3] == d:
                keep = min(start, t.shape[2])
                new[:, :, :keep] = t[:, :, :keep]
            self._t = t = new
        if rows.is_cuda:
            # a device-to-host copy into a strided slice waits for the GPU (through a temporary), four
            # times per layer: it made a step on an H100 1.9x HF generate's. A contiguous pinned block
            # is copied without waiting, and placed in the buffer when the records are read
            stage = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)  # (B, H, n, d)
            stage.copy_(rows, non_blocking=True)
            self._staged.append((stage, start, rows.device))
        else:
            if self._staged:  # staged rows were written first: they land first (a restore overwrites them)
                self._settle()
            t[:, :, start:end].copy_(rows)

    def _settle(self) -> None:
        staged, self._staged = self._staged, []
        assert self._t is not None  # a staged row was written into a buffer that exists
        for dev in {dev for _, _, dev in staged}:  # the copies were queued on the accelerators' streams
            torch.cuda.synchronize(dev)
        with torch.inference_mode():  # the buffer was made by a forward, as an inference tensor
            for stage, start, _ in staged:  # in order: a row written twice (after an undo) ends as the later
                self._t[:, :, start : start + stage.shape[2]] = stage

    def view(self, length: int) -> torch.Tensor:
        t = self.t
        assert t is not None
        return t[:, :, :length]

    def reorder(self, index: torch.Tensor) -> None:
        t = self.t
        if t is not None:
            self._t = t.index_select(0, index.cpu())

    def nbytes(self, length: int) -> int:
        if self._t is None:
            return 0
        b, h, _, d = self._t.shape
        return b * h * length * d * self._t.element_size()
