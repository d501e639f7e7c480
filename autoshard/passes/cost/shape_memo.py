"""The planner's memos of shape-dependent terms, kept for the few most recently planned sequence lengths.

Contract
  `ShapeMemo(keep=KEEP)`: `memo.at(seq_len) -> dict`, the dict that holds the entries of that sequence length
  (the caller keys them as before); asking for a sequence length not among the `keep` most recently asked drops
  the dict of the least recently asked one, whole. `memo.held() -> dict` {seq_len: dict}, least recent first,
  without touching the order; `len(memo)`: the entries held over the kept sequence lengths.

The whole contract: docs/modules/cost.md (passes/cost/shape_memo.py).
"""

from __future__ import annotations

from autoshard.ir import is_positive_int

KEEP = 8


class ShapeMemo:
    """See docs/modules/cost.md."""

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
