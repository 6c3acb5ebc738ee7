"""A request as the scheduler and the KV-cache manager see it."""

from __future__ import annotations

from typing import Optional, Sequence

from kvproof.impl.hashing import RequestBlockHasher


class Request:
    """Token ids known so far (prompt + sampled outputs), how many are computed, and the
    chained block hashes of the known tokens.

    ``num_computed_tokens`` counts positions whose KV / state the model has produced.
    ``append_output`` mutates: it records a sampled token and extends the hashes.
    """

    __slots__ = (
        "request_id", "num_prompt_tokens", "token_ids", "hasher", "num_computed_tokens",
        "num_cached_tokens", "cache_salt", "arrival", "expected_outputs", "num_preemptions",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        hash_block_size: int,
        *,
        cache_salt: Optional[str] = None,
        arrival: int = 0,
        expected_outputs: Sequence[int] = (),
        hash_algo: str = "sha256",
    ) -> None:
        if len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: prompt must hold at least one token")
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt)
        self.token_ids: list[int] = list(prompt)
        self.cache_salt = cache_salt
        self.hasher = RequestBlockHasher(hash_block_size, algo=hash_algo, cache_salt=cache_salt, token_ids=self.token_ids)
        self.num_computed_tokens = 0
        #: Prefix-cache hit at first scheduling (None until then).
        self.num_cached_tokens: Optional[int] = None
        self.arrival = arrival
        #: The trace's outputs: sampling returns these, one per completed step.
        self.expected_outputs = tuple(expected_outputs)
        self.num_preemptions = 0

    @property
    def block_hashes(self) -> list[bytes]:
        return self.hasher.block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def hashed_len(self) -> int:
        return len(self.hasher.block_hashes) * self.hasher.hash_block_size

    def append_output(self, token: int) -> None:
        self.hasher.append_token(token)  # first: it refuses a bad token before anything changes
        self.token_ids.append(token)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
