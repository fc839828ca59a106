"""The load balancer's wake-up call to the controller (a request is held and no replica is
ready): a credential of its own, sent only to a controller of this user.

The wake token is derived from the LB's admin secret (HMAC), so the controller can check it
while the admin secret itself never leaves the LB: whoever receives a wake-up call can wake
the service, nothing more. And the call goes out only while the API port is held by this
user's process (another user who took the port while the controller was down gets nothing).
"""

from __future__ import annotations

import hashlib
import hmac

from fleetserve.core.sockets import held_by_me, loopback_port


def wake_token(admin_secret: str) -> str:
    return hmac.new(admin_secret.encode(), b"fleetserve-wake", hashlib.sha256).hexdigest()


def may_send_to(url: str) -> bool:
    """A wake-up call may go to `url`: on this machine, only to a listener of this user."""
    port = loopback_port(url)
    return port is None or held_by_me(port)
