"""The token embedding (``VocabEmbedding``): a float table, or a table kept in the quantised format a checkpoint
stores it in (a GGUF file's ``token_embd``), whose looked-up rows are widened per call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mla_runtime.layers.qweight import QuantizedWeight
from mla_runtime.parallel import ParallelContext


class VocabEmbedding(nn.Module):
    """Token embedding; under tensor parallelism each rank holds ``ceil(V / N)`` rows of the vocabulary.

    ``stored`` (set by the loader, with ``weight`` released): the table as the checkpoint stores it, quantised. A
    lookup widens just the rows it reads (``QuantizedWeight.gather_rows``) to the values the whole table widened would
    hold, so a GGUF model's embedding takes its stored bytes (a Q8_0 table a quarter of float32's), not a float copy.
    """

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        self.start, self.stop, rows = par.vocab_split(vocab)
        self.weight = nn.Parameter(torch.zeros(rows, hidden, dtype=dtype), requires_grad=False)
        self.stored: QuantizedWeight | None = None

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.stored is None:
            return F.embedding(ids, self.weight)
        rows = self.stored.gather_rows(ids.reshape(-1).long())
        return rows.to(self.weight.dtype).reshape(*ids.shape, rows.shape[-1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.par.enabled:
            return self._lookup(ids)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        return self.par.all_reduce(self._lookup(local) * mine.unsqueeze(-1).to(self.weight.dtype))
