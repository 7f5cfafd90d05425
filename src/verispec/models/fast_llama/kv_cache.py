"""The fast path's key/value cache (model.py): per-layer keys and values in row slots
that rows join and leave without the others' caches being read or copied.

Legend: R row slots, Hkv kv heads, T positions, D head dim.

What it is not: a paged cache. Every slot has the same capacity (the longest row's room), so a
long row grows every slot (FastLlamaSession._room caps that at the model's context).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .protocol import FastLlama


class KVCache:
    """Per-layer keys/values in row slots: storage [R, Hkv, T, D] for R >= num_rows rows, of
    which rows 0 .. num_rows - 1 are live (``keys``/``values`` are views of them, so the forward
    writes the storage in place). Rows join in the free slots after the live ones and leave by
    moving later rows into their slots, so neither copies the rows that stay where they are;
    both dimensions grow by doubling. Positions past a row's length hold stale values, which
    every pass masks or overwrites (FastLlamaLM.forward)."""

    def __init__(self, lm: FastLlama, num_rows: int, capacity: int) -> None:
        self._head_shape = (lm.num_kv_heads, lm.head_dim)  # Hkv, D
        self._dtype, self._device = lm.dtype, lm.device
        self._num_layers = len(lm.layers)
        self.is_slice = False  # a slots() view of another cache's storage: never regrown
        self.num_rows = num_rows
        self.capacity = capacity
        self._key_store = self._allocate(num_rows, capacity)
        self._value_store = self._allocate(num_rows, capacity)
        self._views(num_rows)
        self._set_layout()

    @property
    def row_capacity(self) -> int:
        return self._key_store[0].shape[0] if self._key_store else 0

    def _allocate(self, num_rows: int, capacity: int) -> list[torch.Tensor]:
        shape = (num_rows, self._head_shape[0], capacity, self._head_shape[1])
        return [torch.zeros(shape, dtype=self._dtype, device=self._device)
                for _ in range(self._num_layers)]

    def _set_layout(self) -> None:
        """``layout``: where the storage lives (every tensor's address) and its shape. A
        captured step writes the storage it was captured over (step_graphs.py), so it may run
        on any cache whose layout is this one, and on no other."""
        self.layout = (tuple(store.data_ptr() for store in self._key_store + self._value_store),
                       self.row_capacity, self.capacity)

    def slot_views(self, num_rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values of the first ``num_rows`` slots, live or free ([R, Hkv, T, D] per
        layer; ensure_rows first): what a step padded to R rows writes (step_graphs.py)."""
        assert num_rows <= self.row_capacity
        return ([store[:num_rows] for store in self._key_store],
                [store[:num_rows] for store in self._value_store])

    def _views(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.keys = [store[:num_rows] for store in self._key_store]  # [B, Hkv, T, D] each
        self.values = [store[:num_rows] for store in self._value_store]

    def slots(self, first: int, num_rows: int) -> KVCache:
        """A cache over slots first .. first + num_rows - 1 (views: writes land here), for
        prefilling joining rows in place; its capacity is fixed (ensure it first)."""
        part = KVCache.__new__(KVCache)
        part._head_shape, part._dtype, part._device = (self._head_shape, self._dtype,
                                                       self._device)
        part._num_layers, part.capacity = self._num_layers, self.capacity
        part.is_slice = True
        part._key_store = [store[first : first + num_rows] for store in self._key_store]
        part._value_store = [store[first : first + num_rows] for store in self._value_store]
        part._views(num_rows)
        part._set_layout()
        return part

    def ensure(self, needed: int) -> None:
        """Room for ``needed`` positions, doubling so that growth is amortized."""
        if needed > self.capacity:
            self._grow(self.row_capacity, max(needed, 2 * self.capacity))

    def ensure_rows(self, needed: int) -> None:
        """Slots for ``needed`` rows, doubling so that joins are amortized."""
        if needed > self.row_capacity:
            self._grow(max(needed, 2 * self.row_capacity), self.capacity)

    def _grow(self, num_slots: int, capacity: int) -> None:
        assert not self.is_slice, "a slots() cache cannot grow: ensure the whole cache first"
        held_rows, held = self.num_rows, self.capacity
        for stores in (self._key_store, self._value_store):
            for i, old in enumerate(stores):
                new = old.new_zeros((num_slots,) + old.shape[1:2] + (capacity,) + old.shape[3:])
                new[:held_rows, :, :held] = old[:held_rows]
                stores[i] = new
        self.capacity = capacity
        self._views(held_rows)
        self._set_layout()

    def add_rows(self, num_rows: int) -> None:
        """The next ``num_rows`` slots become live (ensure_rows first)."""
        assert self.num_rows + num_rows <= self.row_capacity
        self._views(self.num_rows + num_rows)

    def copy_row(self, slot: int, other: KVCache, length: int) -> None:
        """Row 0's first ``length`` positions of ``other`` into slot ``slot`` (ensure_rows and
        ensure first)."""
        for stores, others in ((self._key_store, other._key_store),
                               (self._value_store, other._value_store)):
            for store, source in zip(stores, others):
                store[slot, :, :length] = source[0, :, :length]

    def keep_rows(self, rows: list[int], lengths: Sequence[int] | None = None) -> None:
        """Keep these live rows, in this order: row rows[i] moves to slot i (only the rows whose
        slot changes are copied, and of each only its first ``lengths[row]`` positions when
        given: a moved row's tail beyond them is stale, and copying the whole capacity made a
        leave cost a multiple of what its row held)."""
        moved = [(slot, row) for slot, row in enumerate(rows) if slot != row]
        if moved:
            device = self._device
            used = self.capacity if lengths is None else max(lengths[row] for _, row in moved)
            slots = torch.tensor([slot for slot, _ in moved], dtype=torch.int64, device=device)
            sources = torch.tensor([row for _, row in moved], dtype=torch.int64, device=device)
            for stores in (self._key_store, self._value_store):
                for store in stores:  # the read is a copy, so overlapping moves are safe
                    store[slots, :, :used] = store[:, :, :used].index_select(0, sources)
        self._views(len(rows))
