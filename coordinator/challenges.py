"""Join challenges: a fresh random value per join, taken once, so a join recorded on the way cannot be replayed.

Under mutual TLS a join carries the node's signing request, which its key signs. A node first asks for a challenge
(`JoinChallenge`) and puts it in the request (`atoll.tls.make_csr`); `authz` takes the challenge when the join
arrives. A replayed join brings a challenge that is used or expired, and is refused. The clock is the caller's.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict

CHALLENGE_LIFE_S = 60.0
"""How long a challenge may be used: a join follows its challenge within one call's time, retries included."""
MAX_OUTSTANDING = 100_000
"""Challenges held at most (about 100 bytes each); past it the oldest go, and their joins ask again."""


class JoinChallenges:
    """Outstanding challenges, oldest first. Thread-safe."""

    def __init__(self, life_s: float = CHALLENGE_LIFE_S, max_outstanding: int = MAX_OUTSTANDING):
        self.life_s, self.max_outstanding = life_s, max_outstanding
        self._issued: OrderedDict[str, float] = OrderedDict()
        """challenge -> when it expires"""
        self._lock = threading.Lock()

    def issue(self, now: float) -> str:
        challenge = secrets.token_hex(16)
        with self._lock:
            self._expire(now)
            while len(self._issued) >= self.max_outstanding:
                self._issued.popitem(last=False)
            self._issued[challenge] = now + self.life_s
        return challenge

    def take(self, challenge: str, now: float) -> bool:
        """Whether `challenge` was issued, not taken yet and is still alive; it cannot be taken again."""
        with self._lock:
            expires = self._issued.pop(challenge, None)
            return expires is not None and now <= expires

    def _expire(self, now: float) -> None:
        while self._issued:
            oldest, expires = next(iter(self._issued.items()))
            if expires > now:
                return
            del self._issued[oldest]
