"""The static inputs of a runner step captured in a CUDA graph: two device buffers, their pinned host mirrors,
and how the host fills them for a decode step or one sequence's prefill chunk (or verify step).

A step of `batch` sequences of `tokens` positions each (T = batch x tokens) returning `rows` logits rows:

    wide   int64 [3T + rows + 2]   ids[T] | positions[T] | slots[T] | logits rows[rows] | count | live
    narrow int32 [batch (2 + MP) + 1]   KV lengths[batch] | page table[batch x MP] | first rows[batch + 1]

(MP: the most pages a sequence can hold.) `count` (replays since the run began) and `live` (rows that are real
sequences) are the decode advance's (`kernels.advance.decode_advance`): a decode graph moves its own inputs on
to the next step, so consecutive replays need no upload. Padding rows write their keys into the scratch page
(outside the pool) and attend to it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from onnxgen.backends.batch import BatchStep
from onnxgen.backends.native import paged

RUN_TOKENS = 32  # a decode graph records the chosen tokens of this many consecutive replays


@dataclass
class StepBuffers:
    """A captured step's device inputs (`wide`, `narrow`: the layout above), their pinned host mirrors, the
    event after their last upload, and for decode graphs the token record `toks` (`[RUN_TOKENS, batch]`, each
    replay's greedy tokens). `keys`: the KV length its attention's pipeline depth is chosen for (0: the
    context; `paged.short_blocks`); the key splits are the context's either way, so the graph is right for
    any length. `step`: the attention metadata the graph reads (NOTE: its tensors must stay alive)."""

    batch: int
    tokens: int
    rows: int
    max_pages: int
    wide: torch.Tensor
    narrow: torch.Tensor
    host_wide: torch.Tensor
    host_narrow: torch.Tensor
    uploaded: Any  # torch.cuda.Event
    toks: torch.Tensor | None = None
    keys: int = 0
    step: paged.PagedStep | None = None

    @staticmethod
    def new(
        batch: int,
        tokens: int,
        rows: int,
        max_pages: int,
        page_size: int,
        scratch: int,
        dev: torch.device,
        keys: int = 0,
    ) -> StepBuffers:  # pragma: cuda
        """Buffers for a step of all padding (harmless to run: every row on the scratch page `scratch`),
        uploaded; a decode step (one token and one logits row per sequence) also gets its token record."""
        t, mp, p = batch * tokens, max_pages, page_size
        host_wide = torch.zeros(3 * t + rows + 2, dtype=torch.int64).pin_memory()
        host_narrow = torch.full((batch * (2 + mp) + 1,), scratch, dtype=torch.int32).pin_memory()
        host_narrow[batch * (1 + mp) :] = torch.arange(0, t + 1, tokens, dtype=torch.int32)  # first rows
        w = host_wide.numpy()
        w[t : 2 * t] = np.tile(np.arange(tokens), batch)
        w[2 * t : 3 * t] = scratch * p + w[t : 2 * t] % p
        w[3 * t : 3 * t + rows] = np.arange(batch) * tokens + tokens - 1 if rows == batch else np.arange(rows)
        host_narrow.numpy()[:batch] = tokens
        b = StepBuffers(
            batch,
            tokens,
            rows,
            mp,
            host_wide.to(dev),
            host_narrow.to(dev),
            host_wide,
            host_narrow,
            torch.cuda.Event(),
            keys=keys,
        )
        b.uploaded.record()
        if tokens == 1 and rows == batch:  # a decode step: its replays can follow each other
            b.toks = torch.zeros((RUN_TOKENS, batch), dtype=torch.int64, device=dev)
        return b

    def paged_step(
        self, storage: Any, page_size: int, context: int, per_token: bool
    ) -> paged.PagedStep:  # pragma: cuda
        """The attention metadata of the step: views of the device buffers, and host shapes sized for any KV
        length up to `keys` (by default the `context`), the key splits planned for the whole context either
        way (so a sequence splits alike in every step); `per_token` (a verify step, rowwise): its tokens are
        attended one by one, as decode steps."""
        bm, m, t, mp = self.batch, self.tokens, self.batch * self.tokens, self.max_pages
        return paged.PagedStep(
            storage,
            page_size,
            positions=self.wide[t : 2 * t],
            slots=self.wide[2 * t : 3 * t],
            last=self.wide[3 * t : 3 * t + self.rows],
            page_table=self.narrow[bm : bm * (1 + mp)].view(bm, mp),
            q_starts_t=self.narrow[bm * (1 + mp) :],
            seq_lens_t=self.narrow[:bm],
            q_starts=list(range(0, t + 1, m)),
            seq_lens=[self.keys or context] * bm,
            plan_len=context,
            per_token=per_token,
        )

    def fill(self, step: BatchStep, page_size: int, scratch: int, run: int = 0) -> None:  # pragma: cuda
        """Write `step`'s inputs into the host mirrors and upload them (no synchronisation but with the
        previous upload: the mirrors are rewritten only after it). `run`: the first of `run` decode steps
        whose later replays advance their inputs on the device: the page tables cover the run's last step
        and the sequences are marked live."""
        b, m, P = len(step.seqs), self.tokens, page_size
        t = self.batch * m
        self.uploaded.synchronize()  # NOTE: the host mirrors are rewritten only after their last upload
        wide, nar = self.host_wide.numpy(), self.host_narrow.numpy()
        ids, pos, slots, last = (
            wide[:t],
            wide[t : 2 * t],
            wide[2 * t : 3 * t],
            wide[3 * t : 3 * t + self.rows],
        )
        mp = self.max_pages
        lens, table = nar[: self.batch], nar[self.batch : self.batch * (1 + mp)].reshape(self.batch, mp)
        qs = nar[self.batch * (1 + mp) :]  # each sequence's first row (and the end of the last)
        if m == 1:  # decodes: one token per sequence
            starts = [s.start for s in step.seqs]
            ids[:b] = [s.tokens[0] for s in step.seqs]
            pos[:b] = starts
            slots[:b] = [s.pages[p // P] * P + p % P for s, p in zip(step.seqs, starts, strict=True)]
            last[:] = np.arange(self.batch)
            qs[:] = np.arange(self.batch + 1)
            lens[:b] = np.asarray(starts) + 1
            for i, s in enumerate(step.seqs):  # entries past the run's last position are never read
                end = (starts[i] + max(run, 1) - 1) // P + 1
                table[i, :end] = s.pages[:end]
            # padding rows: one position on the scratch page, attending to it alone
            ids[b:], pos[b:], slots[b:], lens[b:], table[b:, 0] = 0, 0, scratch * P, 1, scratch
        else:  # one sequence's prefill chunk, padded with copies of its last token at the next positions
            (s,) = step.seqs
            n, p0 = len(s.tokens), s.start
            where = np.arange(p0, p0 + m)
            ids[:n], ids[n:] = s.tokens, s.tokens[-1]
            pos[:] = where
            need = (p0 + n - 1) // P + 1
            slots[:n] = np.asarray(s.pages[:need])[where[:n] // P] * P + where[:n] % P
            slots[n:] = scratch * P + where[n:] % P  # the padding's keys go to the scratch page
            lens[0] = p0 + n
            if self.rows == 1:
                last[0] = n - 1
            else:  # a verify step: every real position's row (the padding's rows repeat the last)
                last[:] = np.minimum(np.arange(self.rows), n - 1)
            qs[0], qs[1] = 0, n  # the attention kernels take the n real rows only
            table[0, :need] = s.pages[:need]  # entries past the KV length are never read
        wide[-2:] = 0, (b if run else 0)  # replays since the run began; live rows (`decode_advance`)
        self.wide.copy_(self.host_wide, non_blocking=True)
        self.narrow.copy_(self.host_narrow, non_blocking=True)
        self.uploaded.record()
