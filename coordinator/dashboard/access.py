"""Who may open the dashboard: the job token, or the read-only viewer token (`atoll job viewer-token`).

The viewer token is made at the first ask and kept in the state dir (`viewer-token`, mode 0600) so that it
outlives restarts; without a state dir it lives as long as the process. It opens the dashboard only: the
gRPC service checks the job token, which the viewer token is not, so it cannot join the job or act on it.
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

from atoll.fsutil import atomic_write_text
from atoll.rpc import token_matches

VIEWER_TOKEN_NAME = "viewer-token"


class ViewerToken:
    """The job's viewer token, read from `state_dir` when one was made before."""

    def __init__(self, state_dir: Path | None) -> None:
        self._path = state_dir / VIEWER_TOKEN_NAME if state_dir is not None else None
        self._lock = threading.Lock()
        self._token = ""
        if self._path is not None and self._path.is_file():
            self._token = self._path.read_text(encoding="utf-8").strip()

    @property
    def current(self) -> str:
        """The token if one was made ("" otherwise)."""
        return self._token

    def get_or_create(self) -> str:
        with self._lock:
            if not self._token:
                token = "view-" + secrets.token_urlsafe(24)
                if self._path is not None:
                    atomic_write_text(self._path, token + "\n", mode=0o600)
                self._token = token
            return self._token


def may_view(given: str | None, job_token: str, viewer: ViewerToken | None) -> bool:
    """Whether `given` opens the dashboard: the job token or the viewer token (constant-time comparisons)."""
    if not given:
        return False
    ok = token_matches(given, job_token)
    current = viewer.current if viewer is not None else ""
    return bool(current and token_matches(given, current)) or ok
