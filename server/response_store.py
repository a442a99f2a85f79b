"""Stored Responses (`store: true`, the default): what `GET/DELETE /v1/responses/{id}`,
`previous_response_id` and `item_reference` inputs read. In memory, bounded, least recently used
first out; a restart forgets everything (clients then get a 404 and resend the history)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Stored:
    response: dict           # the response object as returned
    input_items: list[dict]  # this request's own input items (with ids)
    conversation: list[dict]  # every item of the conversation so far: history, input, output


class ResponseStore:
    def __init__(self, max_responses: int = 512):
        self.max = max_responses
        self._by_id: OrderedDict[str, Stored] = OrderedDict()
        self._items: dict[str, tuple[str, dict]] = {}   # item id -> (response id, item)

    def put(self, rid: str, stored: Stored) -> None:
        self._by_id[rid] = stored
        self._by_id.move_to_end(rid)
        for item in stored.input_items + stored.response.get("output", []):
            if isinstance(item.get("id"), str):
                self._items[item["id"]] = (rid, item)
        while len(self._by_id) > self.max:
            old, st = self._by_id.popitem(last=False)
            self._forget_items(old, st)

    def get(self, rid: str) -> Stored | None:
        st = self._by_id.get(rid)
        if st is not None:
            self._by_id.move_to_end(rid)
        return st

    def delete(self, rid: str) -> bool:
        st = self._by_id.pop(rid, None)
        if st is None:
            return False
        self._forget_items(rid, st)
        return True

    def item(self, item_id: str) -> dict | None:
        hit = self._items.get(item_id)
        return hit[1] if hit else None

    def _forget_items(self, rid: str, st: Stored) -> None:
        for item in st.input_items + st.response.get("output", []):
            iid = item.get("id")
            if isinstance(iid, str) and self._items.get(iid, (None,))[0] == rid:
                del self._items[iid]

    def __len__(self) -> int:
        return len(self._by_id)
