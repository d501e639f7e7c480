"""The planner's memos of shape-dependent terms, kept for the few most recently planned sequence lengths.

Contract
  `ShapeMemo(keep=KEEP)`: `memo.at(seq_len) -> dict`, the dict that holds the entries of that sequence length
  (the caller keys them as before); asking for a sequence length not among the `keep` most recently asked drops
  the dict of the least recently asked one, whole. `memo.held() -> dict` {seq_len: dict}, least recent first,
  without touching the order; `len(memo)`: the entries held over the kept sequence lengths.

Why: a long-lived process (a sweep over many shapes, a service) plans many (global batch, seq); what the cost
model keeps over plans that depends on the shape (`compiled.CompiledBlock`'s evaluated polynomials, fused-kernel
scales, node times and block times) would otherwise grow with every new shape (~2 MB of llama-70b's on 1024
devices per shape), while what does not depend on it (a block's TP divisors, `CompiledTable.memo`: the ZeRO
state and parameters, the p2p and state columns' terms) is bounded by the layouts and stays in plain dicts.

Why the sequence length, not (batch, seq): none of those terms reads the global batch, only the sequence length
and the micro-batch, whose candidates are a fixed handful (`planner.candidate_layouts`' 1, 2, 4, 8); so a sweep
over global batches at one sequence length reuses everything, and the unit evicted is all a sequence length's
entries. Why KEEP = 8: a re-plan at a shape still held costs about half of one at a new shape (bench/bench_plan.py,
whose re-plans visit 5 shapes and then the first again, every one held at 8), and 8 of llama-70b's largest
(1024+ devices) cost ~16 MB; a user alternating between a few shapes keeps them all.
"""

from __future__ import annotations

from autoshard.ir import is_positive_int

KEEP = 8


class ShapeMemo:
    """See the module docstring."""

    __slots__ = ("keep", "_by", "_last", "_last_dict")

    def __init__(self, keep: int = KEEP) -> None:
        if not is_positive_int(keep):
            raise ValueError(f"ShapeMemo keeps at least one sequence length, not {keep}")
        self.keep = keep
        self._by: dict = {}  # seq_len -> dict, least recently asked first (dicts keep insertion order)
        self._last, self._last_dict = None, None

    def at(self, seq_len: int) -> dict:
        if seq_len == self._last:  # the common case: a plan asks for its own sequence length many times
            return self._last_dict
        d = self._by.pop(seq_len, None)
        if d is None:
            d = {}
            while len(self._by) >= self.keep:
                del self._by[next(iter(self._by))]
        self._by[seq_len] = d  # now the most recent
        self._last, self._last_dict = seq_len, d
        return d

    def held(self) -> dict:
        return dict(self._by)

    def __len__(self) -> int:
        return sum(len(d) for d in self._by.values())
